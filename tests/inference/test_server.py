"""The CPU policy server over real HTTP: logprobs contract, batching, sampling params, bad input, auth."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import aiohttp
import torch
from prometheus_client import REGISTRY

from broker.messages import Sampling
from tests.inference.conftest import teacher_forced_logprobs


async def post(
    url: str, body: Any = None, *, raw: bytes | None = None, token: str | None = None
) -> tuple[int, Any]:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    async with aiohttp.ClientSession(headers=headers) as s:
        kwargs: dict[str, Any] = {"data": raw} if raw is not None else {"json": body}
        async with s.post(url, timeout=aiohttp.ClientTimeout(total=60), **kwargs) as r:
            text = await r.text()
            return r.status, (await r.json(content_type=None)) if text.strip() else None


async def get(url: str, token: str | None = None) -> tuple[int, Any]:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    async with aiohttp.ClientSession(headers=headers) as s:
        async with s.get(url, timeout=aiohttp.ClientTimeout(total=30)) as r:
            text = await r.text()
            return r.status, text


INIT = {
    "master_address": "127.0.0.1",
    "master_port": 9,
    "rank_offset": 1,
    "world_size": 2,
}  # a well-formed init_info


def completion(prompt: list[int], **kw: Any) -> dict[str, Any]:
    return {
        "prompt": prompt,
        "return_token_ids": True,
        "return_weight_versions": True,
        "logprobs": 0,
    } | kw


async def test_logprobs_equal_teacher_forced_recomputation(server_factory, model_dir: Path) -> None:
    server = await server_factory()
    allowed = list(range(97, 123))
    bodies = [
        completion(
            list(range(1, 4)), max_tokens=12, n=2, temperature=0.7, top_p=0.8, ignore_eos=True
        ),
        completion(list(range(30, 60)), max_tokens=20, temperature=1.3, ignore_eos=True),
        completion(
            [5, 6], max_tokens=15, allowed_token_ids=allowed, temperature=2.0, ignore_eos=True
        ),
        completion(list(range(200, 211)), max_tokens=9, temperature=0.0, ignore_eos=True),
    ]
    results = await asyncio.gather(*(post(server.url + "/v1/completions", b) for b in bodies))
    worst = 0.0
    for body, (status, data) in zip(bodies, results, strict=True):
        assert status == 200, data
        assert len(data["choices"]) == body.get("n", 1)
        for choice in data["choices"]:
            tokens = choice["token_ids"]
            assert len(tokens) == body["max_tokens"] and choice["finish_reason"] == "length"
            assert choice["prompt_token_ids"] == body["prompt"]
            assert choice["weight_versions"] == [{"version": "0", "start": 0, "end": len(tokens)}]
            got = torch.tensor(choice["logprobs"]["token_logprobs"])
            sampling = Sampling(
                body["temperature"],
                top_p=body.get("top_p", 1.0),
                allowed_token_ids=body.get("allowed_token_ids"),
            )
            ref = teacher_forced_logprobs(model_dir, body["prompt"], tokens, sampling)
            worst = max(worst, float((got - ref).abs().max()))
            if "allowed_token_ids" in body:
                assert set(tokens) <= set(allowed)
                # processed logprobs: renormalised over the allowed set, as vLLM reports them
                full = teacher_forced_logprobs(model_dir, body["prompt"], tokens, Sampling(2.0))
                assert bool((got > full + 1e-3).all())
    assert worst < 1e-4
    assert data["usage"]["completion_tokens"] == 9


async def test_concurrent_requests_share_forward_passes(server_factory) -> None:
    server = await server_factory(batch_window_ms=20)
    before_sum = REGISTRY.get_sample_value("farm_inference_batch_size_sum") or 0.0
    before_count = REGISTRY.get_sample_value("farm_inference_batch_size_count") or 0.0
    bodies = [completion([i + 1, i + 2], max_tokens=10, ignore_eos=True) for i in range(8)]
    results = await asyncio.gather(*(post(server.url + "/v1/completions", b) for b in bodies))
    assert all(status == 200 for status, _ in results)
    rows = REGISTRY.get_sample_value("farm_inference_batch_size_sum") - before_sum
    passes = REGISTRY.get_sample_value("farm_inference_batch_size_count") - before_count
    assert rows == 8 * 10  # every sampled token came from exactly one forward row
    assert passes <= 8 * 10 / 4  # far fewer forward passes than tokens: they were batched


async def test_seed_greedy_stop_and_eos(server_factory) -> None:
    server = await server_factory()
    url = server.url + "/v1/completions"
    body = completion([1, 2, 3], max_tokens=16, seed=11, ignore_eos=True)
    (_, a), (_, b) = await asyncio.gather(post(url, body), post(url, body))
    _, c = await post(url, body | {"seed": 12})
    assert a["choices"][0]["token_ids"] == b["choices"][0]["token_ids"]
    assert a["choices"][0]["token_ids"] != c["choices"][0]["token_ids"]
    # A stop token ends the choice, is included in token_ids, and is reported as stop_reason.
    _, d = await post(
        url, completion([1], max_tokens=5, allowed_token_ids=[65], stop_token_ids=[65])
    )
    assert d["choices"][0]["token_ids"] == [65]
    assert (d["choices"][0]["finish_reason"], d["choices"][0]["stop_reason"]) == ("stop", 65)
    # EOS (<|im_end|> = 258) stops without a stop_reason unless ignore_eos.
    _, e = await post(url, completion([1], max_tokens=5, allowed_token_ids=[258]))
    assert e["choices"][0]["token_ids"] == [258] and e["choices"][0]["finish_reason"] == "stop"
    assert e["choices"][0]["stop_reason"] is None
    _, f = await post(url, completion([1], max_tokens=3, allowed_token_ids=[258], ignore_eos=True))
    assert (
        f["choices"][0]["token_ids"] == [258] * 3 and f["choices"][0]["finish_reason"] == "length"
    )


BAD_BODIES = [
    ({"prompt": [1, 2, 99999]}, "vocabulary"),
    ({"prompt": [1, -2]}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": ""}, "prompt"),  # text prompts are served (test_openai_completions)
    ({"prompt": [[1, 100000]]}, "vocabulary"),
    ({"prompt": [1], "max_tokens": "7"}, "max_tokens"),
    ({"prompt": [1], "max_tokens": 0}, "max_tokens"),
    ({"prompt": [1], "max_tokens": 10**9}, "context length"),
    ({"prompt": [1], "temperature": -1}, "temperature"),
    ({"prompt": [1], "temperature": "hot"}, "temperature"),
    ({"prompt": [1], "top_p": 0}, "top_p"),
    ({"prompt": [1], "top_p": 1.5}, "top_p"),
    ({"prompt": [1], "n": 0}, "n"),
    ({"prompt": [1], "n": 10_000}, "n"),
    ({"prompt": [1], "logprobs": 99}, "logprobs"),
    ({"prompt": [1], "seed": "x"}, "seed"),
    ({"prompt": [1], "seed": 2**80}, "seed"),
    ({"prompt": [1], "max_tokens": 5.0}, "max_tokens"),
    ({"prompt": [1], "stop_token_ids": [1, 100000]}, "vocabulary"),
    ({"prompt": [1], "allowed_token_ids": []}, "allowed_token_ids"),
    ({"prompt": [1], "allowed_token_ids": [True]}, "allowed_token_ids"),
    ({"prompt": [1], "return_token_ids": "yes"}, "return_token_ids"),
    ({"prompt": [1], "stream": True, "stream_options": 5}, "stream_options"),
    ({"prompt": [1], "top_k": -2}, "top_k"),
    ({"prompt": [1], "top_k": 2.5}, "top_k"),
    ({"prompt": [1], "min_p": 1.5}, "min_p"),
    ({"prompt": [1], "min_p": "x"}, "min_p"),
    ({"prompt": [1], "repetition_penalty": 1.2}, "repetition_penalty"),
    ({"max_tokens": 3}, "prompt"),
    ([1, 2, 3], "JSON object"),
]


async def test_bad_completion_requests_get_400_and_server_keeps_serving(server_factory) -> None:
    server = await server_factory()
    url = server.url + "/v1/completions"
    for body, words in BAD_BODIES:
        status, data = await post(url, body)
        assert status == 400, (body, data)
        assert words.lower() in data["error"]["message"].lower(), (body, data)
        assert data["error"]["code"] == 400
    nonfinite = (b'{"prompt": [1], "temperature": NaN}', b'{"prompt": [1], "top_p": Infinity}')
    for raw in (b'{"prompt": [1, 2', b"", b"\xff\xfe", b"null", *nonfinite):
        status, data = await post(url, raw=raw)
        assert status == 400 and data["error"]["message"], raw
    status, data = await post(url, {"prompt": [1], "model": "someone-else"})
    assert status == 404 and "does not exist" in data["error"]["message"]
    status, data = await post(url, completion([1, 2], max_tokens=2, ignore_eos=True))
    assert status == 200 and len(data["choices"][0]["token_ids"]) == 2


async def test_bad_control_requests_get_4xx(server_factory, tmp_path: Path) -> None:
    server = await server_factory()
    u = server.url
    empty = tmp_path / "empty"
    empty.mkdir()
    cases = [
        (u + "/collective_rpc", {"kwargs": {}}, 400, "method"),
        (u + "/collective_rpc", {"method": "shutdown"}, 400, "not supported"),
        (
            u + "/collective_rpc",
            {"method": "reload_weights", "kwargs": {"weights_path": 5}},
            400,
            "weights_path",
        ),
        (
            u + "/collective_rpc",
            {"method": "reload_weights", "kwargs": {"weights_path": str(tmp_path / "none")}},
            400,
            "does not exist",
        ),
        (
            u + "/collective_rpc",
            {"method": "reload_weights", "kwargs": {"weights_path": str(empty)}},
            400,
            "no *.safetensors",
        ),
        (u + "/update_weight_version", {"new_version": ["x"]}, 400, "new_version"),
        (u + "/update_weight_version", {}, 400, "new_version"),
        (u + "/pause?mode=later", None, 400, "mode"),
        (u + "/update_weights", {"update_info": {}}, 409, "no weight update"),
        (u + "/start_weight_update", None, 409, "not initialised"),
        (u + "/init_weight_transfer_engine", {"init_info": {"master_address": "x"}}, 400, "needs"),
        (
            u + "/init_weight_transfer_engine",
            {"init_info": INIT | {"rank_offset": 0}},
            400,
            "rank_offset",
        ),
        (u + "/init_weight_transfer_engine", {"init_info": INIT | {"packed": True}}, 400, "packed"),
        (
            u + "/init_weight_transfer_engine",
            {"init_info": INIT | {"cpu_path": "x"}},
            400,
            "unexpected",
        ),
    ]
    (tmp_path / "junk.safetensors").write_bytes(b"not a safetensors file")
    cases.append(
        (
            u + "/collective_rpc",
            {
                "method": "reload_weights",
                "kwargs": {"weights_path": str(tmp_path / "junk.safetensors")},
            },
            400,
            "cannot read",
        )
    )
    for url, body, code, words in cases:
        status, data = await post(url, body)
        assert status == code, (url, body, data)
        assert words.lower() in data["error"]["message"].lower(), (url, data)
    status, _ = await post(u + "/collective_rpc", raw=b"{nope")
    assert status == 400
    assert (await get(u + "/weight_info"))[1] == '{"weight_version": "0"}'


async def test_auth_guards_control_and_v1_routes(server_factory) -> None:
    server = await server_factory(api_key="s3cret")
    u = server.url
    for path in (
        "/pause",
        "/resume",
        "/collective_rpc",
        "/update_weight_version",
        "/reset_prefix_cache",
        "/v1/completions",
    ):
        assert (await post(u + path, {}))[0] == 401, path
        assert (await post(u + path, {}, token="wrong"))[0] == 401, path
    assert (await get(u + "/weight_info"))[0] == 401
    assert (await get(u + "/is_paused"))[0] == 401
    assert (await get(u + "/health"))[0] == 200
    status, text = await get(u + "/metrics")
    assert status == 200 and "farm_inference_requests_total" in text
    assert (await post(u + "/pause?mode=keep", token="s3cret")) == (200, {"status": "paused"})
    assert (await post(u + "/resume", token="s3cret")) == (200, {"status": "resumed"})
    status, data = await post(
        u + "/v1/completions", completion([1], max_tokens=2, ignore_eos=True), token="s3cret"
    )
    assert status == 200 and len(data["choices"][0]["token_ids"]) == 2
    status, models = await get(u + "/v1/models", token="s3cret")
    assert status == 200 and '"max_model_len": 4096' in models
