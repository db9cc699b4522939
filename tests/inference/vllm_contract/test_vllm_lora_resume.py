"""The learner's LoRA push against vLLM 0.33's routers and its own worker-side LoRA manager
(`LRUCacheWorkerLoRAManager`, stub_lora): after a learner restart, a re-trained version is
served with the tensors just trained; an unloaded adapter's directory outlives the requests
that may still read it."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import aiohttp

from inference.client import ClientConfig, GenerationClient, SamplingParams, ServedAdapter
from inference.errors import InferenceError
from learner.config import LearnerConfig
from learner.lora import LoraSettings
from learner.weights import PushResult, WeightPusher
from tests.inference.lora_helpers import AdapterSource, adapter_tensors_digest, make_adapter
from tests.inference.vllm_contract.conftest import VllmContract


def pusher(run: str, model: Path, url: str, weights: Path, keep_s: float = 600.0) -> WeightPusher:
    lora = LoraSettings(rank=4, alpha=8.0, adapter_keep_s=keep_s)
    cfg = LearnerConfig(  # type: ignore[call-arg]
        model=model, run=run, inference_urls=[url], weights_dir=weights, lora=lora
    )
    return WeightPusher(cfg)


async def generate(url: str, result: PushResult, version: int, max_tokens: int = 3) -> Any:
    async with GenerationClient([url], ClientConfig(retry_budget_s=30)) as client:
        adapter = ServedAdapter(result.adapter, version)
        return await client.generate([1, 2], SamplingParams(max_tokens=max_tokens), adapter=adapter)


async def test_a_resumed_learner_serves_what_it_trained_not_the_old_tensors(
    vllm_contract: VllmContract, tiny_model_dir: Path, tmp_path: Path
) -> None:
    url = vllm_contract.urls["lora"]
    old = {v: make_adapter(tiny_model_dir, tmp_path / f"old{v}", seed=v) for v in (5, 6)}
    new = {v: make_adapter(tiny_model_dir, tmp_path / f"new{v}", seed=10 + v) for v in (5, 6)}
    first = pusher("resumed", tiny_model_dir, url, tmp_path / "weights")
    for version in (5, 6):
        await first.push(AdapterSource(old[version]), version)
    # the learner dies here; the resumed one restores step 4 and trains versions 5 and 6 again
    second = pusher("resumed", tiny_model_dir, url, tmp_path / "weights")
    for version in (5, 6):
        result = await second.push(AdapterSource(new[version]), version)
        await generate(url, result, version)
        state = vllm_contract.state("lora")
        served = state["generated_with"][-1]
        assert served["model"] == result.adapter
        assert served["tensors"] == adapter_tensors_digest(new[version]), (
            f"version {version} is served with the tensors of before the restart"
        )
    names = {r["model"] for r in vllm_contract.state("lora")["generated_with"]}
    assert len(names) == 2  # each re-trained version is its own adapter
    assert state["dead"] is None


async def test_a_queued_request_outlives_its_adapters_unload_and_eviction(
    vllm_contract: VllmContract, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """A request admitted under version 1 waits in the queue while versions 2-5 are pushed:
    version 1 is unloaded and evicted from vLLM's CPU cache (2 adapters), so its first step
    reads the directory again. Deleting it there would kill the engine core."""
    url = vllm_contract.urls["lora"]
    adapters = {
        v: make_adapter(tiny_model_dir, tmp_path / f"a{v}", seed=20 + v) for v in range(1, 6)
    }
    push = pusher("queued", tiny_model_dir, url, tmp_path / "weights")
    first = await push.push(AdapterSource(adapters[1]), 1)
    async with aiohttp.ClientSession() as session:
        async with session.post(f"{url}/pause?mode=keep") as answer:
            assert answer.status == 200
        queued = asyncio.create_task(generate(url, first, 1))
        try:
            await asyncio.sleep(0.5)  # admitted under version 1, held in the queue
            for version in range(2, 6):
                await push.push(AdapterSource(adapters[version]), version)
        finally:
            async with session.post(f"{url}/resume") as answer:
                assert answer.status == 200
    try:
        generation = await queued
    except InferenceError as exc:
        generation = exc
    state = vllm_contract.state("lora")
    assert state["dead"] is None, f"the engine core died: {state['dead']}"
    assert not isinstance(generation, Exception) and len(generation.token_ids) == 3
    assert state["generated_with"][-1] == {
        "model": first.adapter,
        "tensors": adapter_tensors_digest(adapters[1]),
    }
    assert Path(first.weights_path).is_dir()
