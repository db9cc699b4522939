"""RL control routes: pause modes with requests in flight, weight reload, version labels."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch
from prometheus_client import REGISTRY
from safetensors.torch import load_file

from tests.inference.conftest import eventually, teacher_forced_logprobs
from tests.inference.test_server import completion, get, post


def tokens_generated() -> float:
    return REGISTRY.get_sample_value("farm_inference_tokens_generated_total") or 0.0


async def wait_for_tokens(minimum: float) -> None:
    await eventually(lambda: tokens_generated() >= minimum, within_s=30)


async def test_pause_abort_ends_in_flight_and_refuses_new_requests(server_factory) -> None:
    server = await server_factory()
    url = server.url
    start = tokens_generated()
    long = asyncio.create_task(
        post(url + "/v1/completions", completion([1, 2], max_tokens=3000, ignore_eos=True))
    )
    await wait_for_tokens(start + 5)
    assert await post(url + "/pause?mode=abort") == (200, {"status": "paused"})
    status, data = await asyncio.wait_for(long, 10)
    choice = data["choices"][0]
    assert status == 200 and choice["finish_reason"] == "abort"
    assert 5 <= len(choice["token_ids"]) < 3000
    assert len(choice["logprobs"]["token_logprobs"]) == len(choice["token_ids"])
    assert (await get(url + "/is_paused"))[1] == '{"is_paused": true}'
    # vLLM 0.33 refuses new requests during an abort or wait pause, with a retryable 503
    refused = await post(url + "/v1/completions", completion([3], max_tokens=3, ignore_eos=True))
    assert refused[0] == 503
    assert refused[1]["error"]["type"] == "ServiceUnavailableError"
    assert "paused" in refused[1]["error"]["message"]
    await post(url + "/resume")
    body = completion([3], max_tokens=3, ignore_eos=True)
    status, data = await post(url + "/v1/completions", body)
    assert status == 200 and data["choices"][0]["finish_reason"] == "length"


async def test_pause_wait_lets_in_flight_finish_first(server_factory) -> None:
    server = await server_factory()
    url = server.url
    start = tokens_generated()
    inflight = asyncio.create_task(
        post(url + "/v1/completions", completion([1], max_tokens=150, ignore_eos=True))
    )
    await wait_for_tokens(start + 3)
    status, _ = await post(url + "/pause?mode=wait")
    assert status == 200
    assert tokens_generated() - start == 150  # /pause answered only once the request was complete
    _, data = await asyncio.wait_for(inflight, 10)
    assert data["choices"][0]["finish_reason"] == "length"
    assert len(data["choices"][0]["token_ids"]) == 150
    assert (await post(url + "/v1/completions", completion([2], max_tokens=2)))[0] == 503
    await post(url + "/resume")


@pytest.mark.parametrize("clear_cache", [True, False])
async def test_pause_keep_freezes_and_resumes_under_the_new_version(
    server_factory, model_dir: Path, other_model_dir: Path, clear_cache: bool
) -> None:
    server = await server_factory()
    url = server.url
    start = tokens_generated()
    body = completion([1, 2, 3], max_tokens=400, ignore_eos=True)
    kept = asyncio.create_task(post(url + "/v1/completions", body))
    await wait_for_tokens(start + 5)
    assert (await post(url + f"/pause?mode=keep&clear_cache={str(clear_cache).lower()}"))[0] == 200
    frozen = tokens_generated()
    queued = asyncio.create_task(post(url + "/v1/completions", completion([5], max_tokens=2)))
    await asyncio.sleep(0.3)
    # keep queues new requests (no 503) and generates nothing until resume
    assert tokens_generated() == frozen and not kept.done() and not queued.done()
    rpc = {"method": "reload_weights", "kwargs": {"weights_path": str(other_model_dir)}}
    assert await post(url + "/collective_rpc", rpc) == (200, {"results": [None]})
    assert await post(url + "/update_weight_version", {"new_version": "7"}) == (
        200,
        {"success": True, "new_version": "7"},
    )
    assert (await post(url + "/reset_prefix_cache"))[0] == 200
    await post(url + "/resume")
    status, data = await asyncio.wait_for(kept, 30)
    choice = data["choices"][0]
    assert status == 200 and choice["finish_reason"] == "length" and len(choice["token_ids"]) == 400
    spans = choice["weight_versions"]
    assert [s["version"] for s in spans] == ["0", "7"]
    assert (
        spans[0]["start"] == 0 and spans[0]["end"] == spans[1]["start"] and spans[1]["end"] == 400
    )
    assert (await asyncio.wait_for(queued, 10))[0] == 200
    # With clear_cache (vLLM's default) the frozen sequence recomputes its whole context with
    # the new weights, so its later tokens score exactly as the new model scores them; with
    # clear_cache=false it keeps the KV the old weights computed, and they do not.
    cut = spans[1]["start"]
    lps = torch.tensor(choice["logprobs"]["token_logprobs"])[cut:]
    new_model = teacher_forced_logprobs(other_model_dir, body["prompt"], choice["token_ids"])[cut:]
    gap = float((lps - new_model).abs().max())
    assert gap < 1e-4 if clear_cache else gap > 1e-3


async def test_reload_changes_generations_and_reported_version(
    server_factory, model_dir: Path, other_model_dir: Path
) -> None:
    server = await server_factory()
    url = server.url + "/v1/completions"
    body = completion([10, 20, 30], max_tokens=12, seed=5, ignore_eos=True)
    _, before = await post(url, body)
    await post(server.url + "/pause?mode=keep")
    rpc = {
        "method": "reload_weights",
        "kwargs": {"weights_path": str(other_model_dir / "model.safetensors")},
    }
    assert (await post(server.url + "/collective_rpc", rpc))[0] == 200
    await post(server.url + "/update_weight_version", {"new_version": 1})
    await post(server.url + "/resume")
    assert (await get(server.url + "/weight_info"))[1] == '{"weight_version": "1"}'
    _, after = await post(url, body)
    old, new = before["choices"][0], after["choices"][0]
    assert new["weight_versions"] == [{"version": "1", "start": 0, "end": 12}]
    new_lp = torch.tensor(new["logprobs"]["token_logprobs"])
    assert (
        float(
            (new_lp - teacher_forced_logprobs(other_model_dir, body["prompt"], new["token_ids"]))
            .abs()
            .max()
        )
        < 1e-4
    )
    # The same tokens scored under the old weights differ: the new weights really are in use.
    old_model_lp = teacher_forced_logprobs(model_dir, body["prompt"], new["token_ids"])
    assert float((new_lp - old_model_lp).abs().max()) > 1e-2
    assert old["weight_versions"][0]["version"] == "0"
    _, text = await get(server.url + "/metrics")
    assert "farm_inference_weight_version 1.0" in text


async def test_bad_weights_leave_model_and_version_untouched(
    server_factory, tmp_path: Path, model_dir: Path
) -> None:
    server = await server_factory()
    good = load_file(model_dir / "model.safetensors")
    bad = dict(good)
    name = next(iter(bad))
    bad[name] = torch.zeros(3, 3)  # wrong shape
    from safetensors.torch import save_file

    save_file(bad, tmp_path / "model.safetensors")
    rpc = {"method": "reload_weights", "kwargs": {"weights_path": str(tmp_path)}}
    status, data = await post(server.url + "/collective_rpc", rpc)
    assert status == 400 and "shape" in data["error"]["message"]
    body = completion([4, 5], max_tokens=6, seed=1, ignore_eos=True)
    _, out = await post(server.url + "/v1/completions", body)
    lp = torch.tensor(out["choices"][0]["logprobs"]["token_logprobs"])
    ref = teacher_forced_logprobs(model_dir, body["prompt"], out["choices"][0]["token_ids"])
    assert float((lp - ref).abs().max()) < 1e-4


async def test_pause_wait_after_keep_finishes_the_frozen_requests(server_factory) -> None:
    server = await server_factory()
    url = server.url
    start = tokens_generated()
    frozen = asyncio.create_task(
        post(url + "/v1/completions", completion([1], max_tokens=80, ignore_eos=True))
    )
    await wait_for_tokens(start + 3)
    await post(url + "/pause?mode=keep")
    assert (await asyncio.wait_for(post(url + "/pause?mode=wait"), 30))[0] == 200
    assert tokens_generated() - start == 80
    _, data = await asyncio.wait_for(frozen, 10)
    assert data["choices"][0]["finish_reason"] == "length"
    assert (await get(url + "/is_paused"))[1] == '{"is_paused": true}'
