"""The generation client against real servers: routing, stickiness, failover, cancellation, abort-resume."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from broker.messages import Sampling
from inference.client import (
    ClientConfig,
    GenerationClient,
    InferenceRequestError,
    InferenceUnavailable,
    SamplingParams,
)
from inference.config import ServerConfig
from inference.server import PolicyServer
from tests.conftest import free_port
from tests.inference.conftest import eventually, teacher_forced_logprobs
from tests.inference.test_server import post

FAST = ClientConfig(
    health_interval_s=0.2, backoff_initial_s=0.01, backoff_max_s=0.1, retry_budget_s=30
)


async def test_generation_fields_match_the_model(server_factory, model_dir: Path) -> None:
    server = await server_factory()
    async with GenerationClient([server.url], FAST) as client:
        gen = await client.generate(
            [1, 2, 3], SamplingParams(max_tokens=10, temperature=0.9, seed=3)
        )
    assert gen.server == server.url and 1 <= len(gen.token_ids) <= 10
    assert gen.weight_versions == [0] * len(gen.token_ids)
    ref = teacher_forced_logprobs(model_dir, [1, 2, 3], gen.token_ids, Sampling(0.9))
    assert float((torch.tensor(gen.logprobs) - ref).abs().max()) < 1e-4
    assert gen.finish_reason in ("stop", "length")


async def test_sticky_sessions_and_least_outstanding(server_factory) -> None:
    a, b = await server_factory(), await server_factory()
    params = SamplingParams(max_tokens=4, temperature=1.0)
    async with GenerationClient([a.url, b.url], FAST) as client:
        # Eight concurrent episodes spread over both servers (least outstanding requests) ...
        first = await asyncio.gather(
            *(client.generate([i + 1], params, session_id=f"ep{i}") for i in range(8))
        )
        counts = {u: sum(g.server == u for g in first) for u in (a.url, b.url)}
        assert counts[a.url] == counts[b.url] == 4
        # ... and every later turn of an episode returns to the server of its first turn.
        for _ in range(2):
            later = await asyncio.gather(
                *(client.generate([i + 1, 5], params, session_id=f"ep{i}") for i in range(8))
            )
            assert [g.server for g in later] == [g.server for g in first]
        client.end_session("ep0")
        assert client.session_server("ep0") is None


async def test_bad_request_is_not_retried(server_factory) -> None:
    server = await server_factory()
    async with GenerationClient([server.url], FAST) as client:
        with pytest.raises(InferenceRequestError) as info:
            await client.generate([1, 99999], SamplingParams(max_tokens=2))
    assert info.value.status == 400 and "vocabulary" in info.value.message


async def test_unavailable_after_retry_budget() -> None:
    dead = [f"http://127.0.0.1:{free_port()}", f"http://127.0.0.1:{free_port()}"]
    config = ClientConfig(retry_budget_s=0.5, backoff_initial_s=0.05, connect_timeout_s=0.2)
    async with GenerationClient(dead, config) as client:
        with pytest.raises(InferenceUnavailable, match="retry budget"):
            await client.generate([1], SamplingParams(max_tokens=2))


async def test_wait_healthy_returns_once_a_server_comes_up(model_dir: Path) -> None:
    port = free_port()
    dead = f"http://127.0.0.1:{free_port()}"
    config = ClientConfig(health_timeout_s=1.0, connect_timeout_s=0.5)
    server = PolicyServer(ServerConfig(model=model_dir, port=port))
    async with GenerationClient([dead, f"http://127.0.0.1:{port}"], config) as client:
        assert not await client.wait_healthy(0.3)  # nothing listens yet: False at the limit
        waiting = asyncio.create_task(client.wait_healthy(60, poll_s=0.05))
        await asyncio.sleep(0.3)
        assert not waiting.done()
        await server.start()  # the second URL's server comes up; the first stays dead
        try:
            assert await asyncio.wait_for(waiting, 30)
        finally:
            await server.stop()


async def test_cancellation_aborts_the_server_side_sequence(server_factory) -> None:
    server = await server_factory()
    async with GenerationClient([server.url], FAST) as client:
        # Only byte ids: a sampled EOS would end the request before the poll saw it running.
        no_eos = SamplingParams(max_tokens=3500, allowed_token_ids=tuple(range(256)))
        task = asyncio.create_task(client.generate([1], no_eos))
        await eventually(lambda: bool(server.state.engine._running))
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        # the server noticed the closed connection and freed the slot
        await eventually(lambda: not server.state.engine._running)


async def swap_weights_mid_generation(server: PolicyServer, weights: Path) -> None:
    """What a learner's push does to a generation in flight: pause(abort), reload `weights`,
    label them version 1, resume."""
    await post(server.url + "/pause?mode=abort")
    rpc = {"method": "reload_weights", "kwargs": {"weights_path": str(weights)}}
    await post(server.url + "/collective_rpc", rpc)
    await post(server.url + "/update_weight_version", {"new_version": "1"})
    await post(server.url + "/resume")


async def test_abort_pause_is_continued_across_a_version_change(
    server_factory, other_model_dir: Path
) -> None:
    server = await server_factory()
    async with GenerationClient([server.url], FAST) as client:
        no_eos = SamplingParams(max_tokens=300, allowed_token_ids=tuple(range(256)))
        task = asyncio.create_task(client.generate([1, 2], no_eos))
        await eventually(
            lambda: any(s.tokens for r in server.state.engine._running for s in r.seqs)
        )
        await swap_weights_mid_generation(server, other_model_dir)
        gen = await asyncio.wait_for(task, 30)
    # One whole generation: tokens before the pause under version 0, after it under version 1.
    assert gen.finish_reason == "length" and len(gen.token_ids) == 300
    assert gen.weight_versions[0] == 0 and gen.weight_versions[-1] == 1
    assert sorted(gen.weight_versions) == gen.weight_versions
    assert len(gen.logprobs) == len(gen.weight_versions) == 300


@pytest.mark.slow
async def test_failover_when_a_server_process_is_killed(process_factory, server_factory) -> None:
    (one,) = process_factory(1)
    two = await server_factory()
    params = SamplingParams(max_tokens=60, temperature=1.0)
    async with GenerationClient([one.url, two.url], FAST) as client:
        tasks = [
            asyncio.create_task(client.generate([i + 1], params, session_id=f"s{i}"))
            for i in range(12)
        ]
        await asyncio.sleep(0.3)
        one.kill()  # SIGKILL mid-run: its in-flight requests fail and move to the survivor
        gens = await asyncio.wait_for(asyncio.gather(*tasks), 60)
        assert all(1 <= len(g.token_ids) <= 60 for g in gens)
        assert all(g.server == two.url for g in gens if g.server != one.url)
        later = await client.generate([1], params, session_id="s0")
        assert later.server == two.url  # sticky sessions of the dead server moved
