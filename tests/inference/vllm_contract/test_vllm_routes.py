"""The farm's clients against vLLM 0.33's own routers, handlers and auth middleware.

The generation client, the file weight sync and the NCCL weight sync (over the gloo stand-in,
between this process and the stub server process) are driven through vLLM's HTTP layer; the
stub engine records what reached it, so each test checks the choreography and the data. One
group holds vLLM's workers and the CPU policy server together: both receive the same broadcasts.
"""

from __future__ import annotations

import asyncio
import hashlib
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from inference.client import ClientConfig, GenerationClient, SamplingParams
from inference.config import WeightSyncConfig
from inference.errors import InferenceRequestError, WeightSyncError
from inference.nccl import NcclTransport, gloo_trainer_init
from inference.weight_sync import FileWeightSync, NcclWeightSync
from tests.conftest import free_port
from tests.inference.vllm_contract.conftest import API_KEY, VllmContract


def digest(tensor: torch.Tensor) -> str:
    """The stub engine's digest (stub_engine.digest), recomputed on this side."""
    data = tensor.detach().contiguous().view(torch.uint8).numpy().tobytes()
    return f"{tensor.dtype}:{list(tensor.shape)}:{hashlib.sha256(data).hexdigest()[:16]}"


def weights(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "model.embed_tokens.weight": torch.randn(16, 8, generator=g),
        "model.layers.0.mlp.up_proj.weight": torch.randn(8, 8, generator=g).to(torch.bfloat16),
        "model.norm.weight": torch.randn(8, generator=g),
        "lm_head.bias": torch.arange(5, dtype=torch.int64),
    }


def calls_since(contract: VllmContract, app: str, before: int) -> list[str]:
    return contract.state(app)["calls"][before:]


async def test_generation_client_reads_vllm_completion_response(
    vllm_contract: VllmContract,
) -> None:
    url = vllm_contract.urls["plain"]
    async with GenerationClient([url], ClientConfig(retry_budget_s=5)) as client:
        gen = await client.generate([1, 2], SamplingParams(max_tokens=4))
    assert gen.token_ids == [3, 4, 5, 6]  # the stub's rule: (sum(prompt) + i) % 256
    assert gen.logprobs == pytest.approx([-0.01, -0.02, -0.03, -0.04])
    assert gen.finish_reason == "length" and gen.server == url
    version = vllm_contract.state("plain")["version"]
    assert gen.weight_versions == [int(version) if version.isdigit() else -1] * 4


async def test_a_streamed_generation_reads_vllms_chunks(vllm_contract: VllmContract) -> None:
    """vLLM 0.33 streams token ids per chunk and the versions of the whole output only on the
    final chunk: the client hands the ids on as they come and labels every token at the end;
    a stream cut by a pause(abort) goes on where it stopped."""
    url = vllm_contract.urls["plain"]
    pieces: list[list[int]] = []
    config = ClientConfig(retry_budget_s=20, backoff_initial_s=0.02, health_interval_s=0.05)
    async with GenerationClient([url], config) as client:
        gen = await client.generate([1, 2], SamplingParams(max_tokens=4), on_tokens=pieces.append)
        delivered: list[int] = []
        arrived = asyncio.Event()

        def on_tokens(ids: list[int]) -> None:
            delivered.extend(ids)
            arrived.set()

        task = asyncio.create_task(
            client.generate([0], SamplingParams(max_tokens=60), on_tokens=on_tokens)
        )
        await asyncio.wait_for(arrived.wait(), 10)
        async with _raw() as http:
            await http.post(url + "/pause?mode=abort")
            await asyncio.sleep(0.3)
            await http.post(url + "/resume")
        cut = await asyncio.wait_for(task, 20)
    assert pieces == [[3], [4], [5], [6]] and gen.token_ids == [3, 4, 5, 6]
    assert gen.logprobs == pytest.approx([-0.01, -0.02, -0.03, -0.04])
    version = vllm_contract.state("plain")["version"]
    assert gen.weight_versions == [int(version) if version.isdigit() else -1] * 4
    assert gen.finish_reason == "length"
    assert delivered == cut.token_ids and len(cut.token_ids) == 60
    assert cut.finish_reason == "length"


async def test_vllm_401_and_404_bodies_become_request_errors(vllm_contract: VllmContract) -> None:
    auth = vllm_contract.urls["auth"]
    async with GenerationClient([auth], ClientConfig(api_key="wrong")) as client:
        with pytest.raises(InferenceRequestError) as err:
            await client.generate([1], SamplingParams(max_tokens=2))
    # vLLM's middleware answers {"error": "Unauthorized"}: a string, not an object
    assert err.value.status == 401 and err.value.message == "Unauthorized"
    config = ClientConfig(api_key=API_KEY, served_model_name="not-served")
    async with GenerationClient([auth], config) as client:
        with pytest.raises(InferenceRequestError) as err:
            await client.generate([1], SamplingParams(max_tokens=2))
    assert err.value.status == 404 and "does not exist" in err.value.message


async def test_pause_abort_503_then_resume_completes_the_generation(
    vllm_contract: VllmContract,
) -> None:
    url = vllm_contract.urls["plain"]
    config = ClientConfig(retry_budget_s=20, backoff_initial_s=0.02, health_interval_s=0.05)
    async with GenerationClient([url], config) as client:
        task = asyncio.create_task(client.generate([0], SamplingParams(max_tokens=60)))
        await asyncio.sleep(0.2)
        before = len(vllm_contract.state("plain")["calls"])
        async with _raw() as http:
            await http.post(url + "/pause?mode=abort")
            await asyncio.sleep(0.3)  # the continuation meets vLLM's 503 and backs off
            await http.post(url + "/resume")
        gen = await asyncio.wait_for(task, 20)
    assert len(gen.token_ids) == 60 and gen.finish_reason == "length"
    assert calls_since(vllm_contract, "plain", before) == ["pause:abort", "resume"]


class _raw:
    """A bare aiohttp session (the control calls of a test, not of the code under test)."""

    async def __aenter__(self) -> _raw:
        import aiohttp

        self.session = aiohttp.ClientSession()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.session.close()

    async def post(self, url: str) -> int:
        async with self.session.post(url) as resp:
            await resp.read()
            return resp.status


async def test_file_weight_sync_follows_vllm_routes(
    vllm_contract: VllmContract, tmp_path: Path
) -> None:
    url = vllm_contract.urls["auth"]  # vLLM guards /v1 only; the control routes are open
    before = len(vllm_contract.state("auth")["calls"])
    sync = FileWeightSync([url], WeightSyncConfig(root_dir=tmp_path, api_key=API_KEY))
    tensors = weights(seed=1)
    await sync.push(tensors, None, version=5)
    state = vllm_contract.state("auth")
    assert state["calls"][before:] == [
        "pause:keep",
        "collective_rpc:reload_weights",
        "update_weight_version:5",
        "reset_prefix_cache",
        "resume",
    ]
    assert state["version"] == "5"
    assert state["reloaded"] == {name: digest(t) for name, t in tensors.items()}


async def test_nccl_weight_sync_reaches_every_worker_of_any_layout(
    vllm_contract: VllmContract,
) -> None:
    apps = ("tp2", "pp2dp2")  # 2 + 4 workers: ranks 1-2 and 3-6 behind the trainer's 0
    urls = [vllm_contract.urls[a] for a in apps]
    before = {a: len(vllm_contract.state(a)["calls"]) for a in apps}
    transport = NcclTransport("127.0.0.1", free_port(), trainer_init=gloo_trainer_init(60))
    sync = NcclWeightSync(urls, WeightSyncConfig(root_dir=Path("/nonexistent")), transport)
    await asyncio.wait_for(sync.init(), 60)
    assert sync.rank_offsets == [1, 3] and sync.world_size == 7  # from /get_world_size
    for version, seed in ((7, 2), (8, 3)):  # the group is reused across pushes
        tensors = weights(seed)
        await asyncio.wait_for(sync.push(tensors, version), 60)
        expected = {name: digest(t) for name, t in tensors.items()}
        for app, url in zip(apps, urls, strict=True):
            async with _raw() as http:
                async with http.session.post(
                    url + "/collective_rpc", json={"method": "received_weights"}
                ) as resp:
                    per_worker = (await resp.json())["results"]
            assert per_worker == [expected] * (2 if app == "tp2" else 4)
            assert vllm_contract.state(app)["version"] == str(version)
    for app in apps:
        seen = calls_since(vllm_contract, app, before[app])
        assert [c for c in seen if c != "collective_rpc:received_weights"] == [
            "init_weight_transfer_engine",
            *(
                step
                for v in (7, 8)
                for step in (
                    "pause:keep",
                    "start_weight_update",
                    "update_weights",
                    f"finish_weight_update:{v}",
                    "resume",
                )
            ),
        ]


async def test_nccl_init_info_rejected_by_vllm_is_reported(vllm_contract: VllmContract) -> None:
    class Unknown(NcclTransport):
        def init_info(self, rank_offset: int, world_size: int) -> dict:
            return super().init_info(rank_offset, world_size) | {"not_a_vllm_field": "x"}

    transport = Unknown("127.0.0.1", free_port(), trainer_init=gloo_trainer_init(2))
    url = vllm_contract.urls["plain"]
    sync = NcclWeightSync([url], WeightSyncConfig(root_dir=Path("/x")), transport)
    with pytest.raises(WeightSyncError) as err:
        await asyncio.wait_for(sync.init(), 30)
    assert "HTTP 400" in str(err.value) and "not_a_vllm_field" in str(err.value)


async def test_one_group_feeds_vllm_workers_and_the_cpu_server_alike(
    vllm_contract: VllmContract, server_factory, other_model_dir: Path
) -> None:
    """The CPU server's receive is wire-compatible with vLLM's: in one group, the same
    broadcasts reach vLLM's own receive_weights (2 TP workers) and the CPU server."""
    cpu = await server_factory()
    urls = [vllm_contract.urls["tp2"], cpu.url]
    transport = NcclTransport("127.0.0.1", free_port(), trainer_init=gloo_trainer_init(60))
    sync = NcclWeightSync(urls, WeightSyncConfig(root_dir=Path("/nonexistent")), transport)
    await asyncio.wait_for(sync.init(), 60)
    assert sync.rank_offsets == [1, 3] and sync.world_size == 4
    tensors = load_file(other_model_dir / "model.safetensors")
    await asyncio.wait_for(sync.push(tensors, 11), 60)
    expected = {name: digest(t) for name, t in tensors.items()}
    async with _raw() as http:
        async with http.session.post(
            urls[0] + "/collective_rpc", json={"method": "received_weights"}
        ) as resp:
            per_worker = (await resp.json())["results"]  # every push of the session so far
    assert [{name: got[name] for name in expected} for got in per_worker] == [expected] * 2
    loaded = cpu.state.engine.model.state_dict()
    assert {name: digest(loaded[name]) for name in tensors} == expected
    assert vllm_contract.state("tp2")["version"] == "11" == cpu.state.engine.version
    sync.close()
