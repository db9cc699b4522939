"""Workers ask for the run's current LoRA adapter by name (real redis-server, real CPU server):
the recorded version is the adapter's, and an unloaded adapter sends the turn to the current one."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import torch

from broker.connection import RedisSettings, connect
from broker.keys import RunKeys
from broker.messages import PolicyVersion
from broker.policy import publish_policy
from inference.adapter_sync import AdapterSync, adapter_name
from inference.client import GenerationClient, InferenceUnavailable, SamplingParams
from inference.config import ClientConfig, ServerConfig, WeightSyncConfig
from inference.server import PolicyServer
from tests.inference.lora_helpers import make_adapter, peft_logprobs
from workers.agent_endpoint import AgentEndpoint, SamplingDefaults
from workers.agent_record import AgentLimits, EpisodeRecord
from workers.agent_transport import in_process_client
from workers.policy_model import PolicyModel
from workers.tokens import load_codec

PROMPT = [5, 6, 7, 8, 9]
PARAMS = SamplingParams(max_tokens=6, seed=3)


@pytest.fixture
async def server(tiny_model_dir: Path) -> AsyncIterator[PolicyServer]:
    config = ServerConfig(model=tiny_model_dir, port=0, enable_lora=True, max_loras=2)
    async with PolicyServer(config) as running:
        yield running


@pytest.fixture
async def client(server: PolicyServer) -> AsyncIterator[GenerationClient]:
    config = ClientConfig(retry_budget_s=1.0, backoff_initial_s=0.01)
    async with GenerationClient([server.url], config) as running:
        yield running


async def test_turns_use_the_current_adapter_and_record_its_version(
    redis_server, server: PolicyServer, client: GenerationClient, tiny_model_dir: Path, tmp_path
) -> None:
    redis = await connect(RedisSettings.from_url(redis_server.url))
    keys = RunKeys("lora")
    sync = AdapterSync([server.url], WeightSyncConfig(root_dir=tmp_path / "w"))
    model = PolicyModel(client, redis, keys, refresh_s=3600.0)  # re-reads only when forced
    try:
        base = await model.generate(PROMPT, PARAMS)  # no policy published: base weights
        assert base.weight_versions == [0] * 6  # the server's own label
        paths = {}
        for version in (1, 2):
            name = adapter_name("lora", version)
            paths[version] = make_adapter(tiny_model_dir, tmp_path / name, seed=version)
            await sync.load(name, paths[version], version)
            await publish_policy(redis, keys, PolicyVersion(version, version, adapter=name))
            if version == 1:
                # the cached policy is stale (none), so force the first read, as a refresh would
                assert (await model.current(force=True)).name == "lora-v1"
                gen = await model.generate(PROMPT, PARAMS)
                assert gen.weight_versions == [1] * 6
                ref = peft_logprobs(tiny_model_dir, paths[1], PROMPT, gen.token_ids)
                assert float((torch.tensor(gen.logprobs) - ref).abs().max()) < 1e-4
        await sync.unload("lora-v1")  # the learner moved on while this worker still holds v1
        assert (await model.current()).name == "lora-v1"
        gen = await model.generate(PROMPT, PARAMS)  # 404 on v1: re-read, same turn on v2
        assert gen.weight_versions == [2] * 6
        ref = peft_logprobs(tiny_model_dir, paths[2], PROMPT, gen.token_ids)
        assert float((torch.tensor(gen.logprobs) - ref).abs().max()) < 1e-4
        assert (await model.current()).name == "lora-v2"
    finally:
        await redis.aclose()


async def test_an_adapter_no_server_has_fails_as_inference_unavailable(
    redis_server, client: GenerationClient
) -> None:
    """A restarted server has lost its runtime-loaded adapters: retries end within the budget."""
    redis = await connect(RedisSettings.from_url(redis_server.url))
    keys = RunKeys("lost")
    try:
        await publish_policy(redis, keys, PolicyVersion(4, 4, adapter="lost-v4"))
        model = PolicyModel(client, redis, keys, refresh_s=0.01, backoff_s=0.05)
        with pytest.raises(InferenceUnavailable, match="lost-v4 is the current policy"):
            await model.generate(PROMPT, PARAMS)
    finally:
        await redis.aclose()


async def test_two_runs_on_one_server_record_their_own_adapters_and_versions(
    redis_server, server: PolicyServer, client: GenerationClient, tiny_model_dir: Path, tmp_path
) -> None:
    """Two runs, each with its learner's AdapterSync and its workers' PolicyModel, share one
    server and one client: concurrent turns of both come from their own run's adapter."""
    redis = await connect(RedisSettings.from_url(redis_server.url))
    try:
        runs = {"alpha": 3, "beta": 5}  # each run's current version
        models, paths = {}, {}
        for run, version in runs.items():
            keys = RunKeys(run)
            sync = AdapterSync([server.url], WeightSyncConfig(root_dir=tmp_path / run))
            name = adapter_name(run, version)
            paths[run] = make_adapter(tiny_model_dir, tmp_path / name, seed=version)
            await sync.load(name, paths[run], version)
            await publish_policy(redis, keys, PolicyVersion(version, version, adapter=name))
            models[run] = PolicyModel(client, redis, keys)
        order = ["alpha", "beta"] * 3
        params = [SamplingParams(max_tokens=5, seed=i) for i in range(len(order))]
        gens = await asyncio.gather(
            *(models[run].generate(PROMPT, p) for run, p in zip(order, params, strict=True))
        )
        for run, gen in zip(order, gens, strict=True):
            assert gen.weight_versions == [runs[run]] * 5
            ref = peft_logprobs(tiny_model_dir, paths[run], PROMPT, gen.token_ids)
            assert float((torch.tensor(gen.logprobs) - ref).abs().max()) < 1e-4, run
    finally:
        await redis.aclose()


async def test_an_unreadable_policy_keeps_the_adapter_read_last(
    redis_server, server: PolicyServer, client: GenerationClient, tiny_model_dir: Path, tmp_path
) -> None:
    redis = await connect(RedisSettings.from_url(redis_server.url))
    keys = RunKeys("odd")
    try:
        sync = AdapterSync([server.url], WeightSyncConfig(root_dir=tmp_path / "w"))
        await sync.load("odd-v1", make_adapter(tiny_model_dir, tmp_path / "a", seed=1), 1)
        await publish_policy(redis, keys, PolicyVersion(1, 1, adapter="odd-v1"))
        model = PolicyModel(client, redis, keys, refresh_s=0.01)
        assert (await model.current()).name == "odd-v1"
        # a policy entry from a newer schema than this worker knows
        await redis.hset(keys.policy_version, mapping={b"k": b"policy", b"v": b"99", b"b": b""})
        await asyncio.sleep(0.02)
        assert (await model.current(force=True)).name == "odd-v1"
        assert (await model.generate(PROMPT, PARAMS)).weight_versions == [1] * 6
    finally:
        await redis.aclose()


async def test_the_agent_endpoint_streams_through_the_policy_model(
    redis_server, client: GenerationClient, tiny_model_dir: Path
) -> None:
    """The worker hands its endpoint a PolicyModel, not the bare client: a streamed call
    must reach the client's token stream through it (it once raised a TypeError there)."""
    redis = await connect(RedisSettings.from_url(redis_server.url))
    model = PolicyModel(client, redis, RunKeys("stream"), refresh_s=3600.0)
    endpoint = AgentEndpoint(load_codec(str(tiny_model_dir)), model)
    await endpoint.start()
    try:
        pieces: list[int] = []
        streamed = await model.generate(PROMPT, PARAMS, on_tokens=pieces.extend)
        assert pieces == streamed.token_ids == (await model.generate(PROMPT, PARAMS)).token_ids
        record = EpisodeRecord(AgentLimits(5, 1000, 4096, 60), policy_version=0)
        key = endpoint.open_episode(record, "t/0", SamplingDefaults(1.0, 1.0, 6))
        body = {"messages": [{"role": "user", "content": "hi"}], "stream": True}
        async with in_process_client(endpoint) as http:
            reply = await http.post(
                endpoint.base_url + "/chat/completions",
                json=body,
                headers={"Authorization": f"Bearer {key}"},
            )
        events = [e for e in reply.text.split("\n\n") if e]
        assert reply.status_code == 200 and events[-1] == "data: [DONE]"
        assert not any('"error"' in e for e in events) and len(record.turns) == 1
    finally:
        await endpoint.close()
        await redis.aclose()
