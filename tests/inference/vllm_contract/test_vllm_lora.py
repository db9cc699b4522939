"""The adapter push and adapter generation against vLLM 0.33's own runtime-LoRA router,
`OpenAIServingModels` and request models, and the CPU server's answers held to vLLM's."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from inference.adapter_sync import AdapterSync
from inference.client import (
    AdapterNotServed,
    ClientConfig,
    GenerationClient,
    SamplingParams,
    ServedAdapter,
)
from inference.config import ServerConfig, WeightSyncConfig
from inference.errors import WeightSyncError
from inference.server import PolicyServer
from tests.inference.lora_helpers import edit_config, make_adapter
from tests.inference.vllm_contract.conftest import API_KEY, VllmContract


def sync_config(tmp_path: Path, **kw: Any) -> WeightSyncConfig:
    return WeightSyncConfig(root_dir=tmp_path, attempts=2, backoff_s=0.01, **kw)


def without_paths(message: str) -> str:
    """vLLM's `sanitize_message` path rule: its errors say `<path>`, the CPU server's the path."""
    return re.sub(r"/(?:home|usr|opt|var|tmp|root|lib|mnt|srv)(?:/[\w.\-]+)+", "<path>", message)


async def call(url: str, body: Any) -> tuple[int, Any]:
    async with aiohttp.ClientSession() as s:
        async with s.post(url, json=body, timeout=aiohttp.ClientTimeout(30)) as r:
            text = await r.text()
            try:
                return r.status, await r.json(content_type=None)
            except ValueError:
                return r.status, text


async def test_adapter_push_generation_and_unload_through_vllm_routes(
    vllm_contract: VllmContract, tiny_model_dir: Path, tmp_path: Path
) -> None:
    urls = [vllm_contract.urls["plain"], vllm_contract.urls["tp2"]]
    adapter = make_adapter(tiny_model_dir, tmp_path / "a", seed=1)
    sync = AdapterSync(urls, sync_config(tmp_path))
    await sync.load("contract-v1", adapter, 1)  # vLLM's /v1/models then lists it from `adapter`
    state = vllm_contract.state("plain")
    assert str(adapter) in state["loras"].values()
    lora_id = next(int(i) for i, p in state["loras"].items() if p == str(adapter))
    await sync.load("contract-v1", adapter, 1)  # a retried push: "already loaded", same path
    other = make_adapter(tiny_model_dir, tmp_path / "b", seed=2)
    with pytest.raises(WeightSyncError) as err:
        await sync.load("contract-v1", other, 1)  # the name is taken by another directory
    assert set(err.value.failures) == set(urls)
    assert f"serves adapter 'contract-v1' from {adapter}, not {other}" in str(err.value)
    async with GenerationClient(urls[:1], ClientConfig(retry_budget_s=5)) as client:
        served = ServedAdapter("contract-v1", 1)
        gen = await client.generate([1, 2], SamplingParams(max_tokens=3), adapter=served)
        # vLLM's CompletionRequest took model=<adapter>; the stub's adapter rule shifts tokens
        assert gen.token_ids == [(3 + i + 100 * lora_id) % 256 for i in range(3)]
        # vLLM's label is engine-wide ("default" here); the turn gets the adapter's version
        assert gen.weight_versions == [1, 1, 1]
        await sync.unload("contract-v1")
        with pytest.raises(AdapterNotServed) as gone:
            await client.generate([1, 2], SamplingParams(max_tokens=3), adapter=served)
        assert gone.value.adapter == "contract-v1" and gone.value.status == 404
    await sync.unload("contract-v1")  # vLLM's 404 for a name not loaded: already the end state


async def test_vllm_refusals_reach_the_pusher(
    vllm_contract: VllmContract, tiny_model_dir: Path, tmp_path: Path
) -> None:
    url = vllm_contract.urls["plain"]
    sync = AdapterSync([url], sync_config(tmp_path))
    with pytest.raises(WeightSyncError, match="No adapter found for"):
        await sync.load("refused-v1", tmp_path / "absent", 1)
    big = make_adapter(tiny_model_dir, tmp_path / "big", seed=3, r=32)
    with pytest.raises(WeightSyncError, match="LoRA rank 32 is greater than max_lora_rank 16"):
        await sync.load("refused-v2", big, 2)
    dora = edit_config(make_adapter(tiny_model_dir, tmp_path / "dora", seed=4), use_dora=True)
    with pytest.raises(WeightSyncError, match="vLLM does not yet support DoRA"):
        await sync.load("refused-v3", dora, 3)
    keyed = AdapterSync([vllm_contract.urls["auth"]], sync_config(tmp_path, api_key=API_KEY))
    await keyed.load("keyed-v1", make_adapter(tiny_model_dir, tmp_path / "k", seed=5), 1)
    no_key = AdapterSync([vllm_contract.urls["auth"]], sync_config(tmp_path))
    with pytest.raises(WeightSyncError, match="HTTP 401"):
        await no_key.unload("keyed-v1")


async def test_cpu_server_answers_the_lora_routes_as_vllm_does(
    vllm_contract: VllmContract, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """Same requests to vLLM's router and to the CPU server: same status and message (except
    that vLLM answers 500 where its loader refuses an adapter; the CPU server 400)."""
    config = ServerConfig(model=tiny_model_dir, port=0, enable_lora=True)
    adapter = make_adapter(tiny_model_dir, tmp_path / "a", seed=6)
    big = make_adapter(tiny_model_dir, tmp_path / "big", seed=7, r=32)
    vllm = vllm_contract.urls["plain"]
    async with PolicyServer(config) as cpu:
        requests = [
            ("/v1/load_lora_adapter", {"lora_name": "same-v1", "lora_path": str(adapter)}),
            ("/v1/load_lora_adapter", {"lora_name": "same-v1", "lora_path": str(adapter)}),
            ("/v1/load_lora_adapter", {"lora_name": "same-v2", "lora_path": str(tmp_path / "x")}),
            ("/v1/load_lora_adapter", {"lora_name": "same-v3", "lora_path": str(big)}),
            ("/v1/load_lora_adapter", {"lora_name": "", "lora_path": str(adapter)}),
            ("/v1/unload_lora_adapter", {"lora_name": "never-loaded"}),
            ("/v1/unload_lora_adapter", {"lora_name": "same-v1"}),
        ]
        for route, body in requests:
            ours, theirs = await call(cpu.url + route, body), await call(vllm + route, body)
            if theirs[0] == 500:
                assert ours[0] == 400
            else:
                assert ours[0] == theirs[0], (route, body, ours, theirs)
            if theirs[0] == 200:
                assert ours[1] == theirs[1]
                continue
            assert without_paths(ours[1]["error"]["message"]) == theirs[1]["error"]["message"]
            assert ours[1]["error"]["type"] == theirs[1]["error"]["type"] or theirs[0] == 500
            assert vllm_contract.validate("ErrorResponse", ours[1])["ok"]
        await call(cpu.url + "/v1/load_lora_adapter", requests[0][1])
        async with aiohttp.ClientSession() as s:
            async with s.get(cpu.url + "/v1/models") as r:
                listing = await r.json()
        assert vllm_contract.validate("ModelList", listing) == {"ok": True, "extra": []}
        assert [c["parent"] for c in listing["data"]] == [None, listing["data"][0]["id"]]
