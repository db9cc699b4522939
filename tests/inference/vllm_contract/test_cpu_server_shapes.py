"""The CPU policy server's bodies held to vLLM 0.33's own types and answers.

Completions and error bodies are validated by vLLM's pydantic models (in the vLLM process);
the control routes are asked the same question on the CPU server and on vLLM's routers, and
must answer with the same status and the same keys and value types.
"""

from __future__ import annotations

import json
from typing import Any

from tests.inference.test_server import completion, get, post
from tests.inference.vllm_contract.conftest import API_KEY, VllmContract


def shape(value: Any) -> Any:
    """Keys and JSON types, not values."""
    if isinstance(value, dict):
        return {k: shape(v) for k, v in value.items()}
    if isinstance(value, list):
        return [shape(v) for v in value[:1]]
    return type(value).__name__


async def test_completion_and_error_bodies_validate_as_vllm_models(
    server_factory, vllm_contract: VllmContract
) -> None:
    server = await server_factory()
    body = completion([1, 2, 3], max_tokens=5, logprobs=2, n=2, seed=3)
    status, data = await post(server.url + "/v1/completions", body)
    assert status == 200
    assert vllm_contract.validate("CompletionResponse", data) == {"ok": True, "extra": []}
    for choice in data["choices"]:
        assert vllm_contract.validate("CompletionResponseChoice", choice) == {
            "ok": True,
            "extra": [],
        }
    # weight_versions are vLLM's WeightVersionSpan: a bad span must fail vLLM's validation
    broken = dict(data["choices"][0], weight_versions=[{"version": 7, "start": "x"}])
    assert vllm_contract.validate("CompletionResponseChoice", broken)["ok"] is False
    errors = [
        await post(server.url + "/v1/completions", {"max_tokens": 5}),  # no prompt
        await post(server.url + "/v1/completions", completion([1], model="nope")),
        await post(server.url + "/v1/completions", raw=b"{not json"),
    ]
    await post(server.url + "/pause?mode=abort")
    errors.append(await post(server.url + "/v1/completions", completion([1])))
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    errors.append(await post(server.url + "/v1/chat/completions", chat))  # every route refuses
    await post(server.url + "/resume")
    assert [s for s, _ in errors] == [400, 404, 400, 503, 503]
    for _, err in errors:
        assert vllm_contract.validate("ErrorResponse", err) == {"ok": True, "extra": []}


async def test_paused_503_and_401_bodies_match_vllm(
    server_factory, vllm_contract: VllmContract
) -> None:
    cpu = await server_factory(api_key=API_KEY)
    vllm = vllm_contract.urls["auth"]
    answers = []
    for url in (cpu.url, vllm):
        unauthorised = await post(url + "/v1/completions", completion([1]), token="wrong")
        await post(url + "/pause?mode=wait", token=API_KEY)
        paused = await post(url + "/v1/completions", completion([1]), token=API_KEY)
        await post(url + "/resume", token=API_KEY)
        answers.append((unauthorised, paused))
    assert answers[0] == answers[1]
    assert answers[0][0] == (401, {"error": "Unauthorized"})


async def test_control_routes_answer_like_vllm(
    server_factory, model_dir, vllm_contract: VllmContract
) -> None:
    cpu = await server_factory()
    vllm = vllm_contract.urls["plain"]
    asks: list[tuple[str, str, Any]] = [
        ("POST", "/pause?mode=keep", None),
        ("GET", "/is_paused", None),
        ("POST", "/update_weight_version", {"new_version": "11"}),
        ("GET", "/weight_info", None),
        ("POST", "/reset_prefix_cache", None),
        (
            "POST",
            "/collective_rpc",
            {"method": "reload_weights", "kwargs": {"weights_path": str(model_dir)}},
        ),
        ("POST", "/resume", None),
        ("GET", "/is_paused", None),
        ("GET", "/get_world_size?include_dp=true", None),
        ("POST", "/collective_rpc", {"kwargs": {}}),
        ("POST", "/update_weight_version", {}),
    ]
    for method, path, body in asks:
        got = []
        for url in (cpu.url, vllm):
            if method == "GET":
                status, text = await get(url + path)
                got.append((status, json.loads(text)))
            else:
                got.append(await post(url + path, body))
        (cpu_status, cpu_body), (vllm_status, vllm_body) = got
        assert cpu_status == vllm_status, (method, path, got)
        if cpu_status >= 400:  # both are vLLM ErrorResponses (messages and params may differ)
            for err in (cpu_body, vllm_body):
                assert vllm_contract.validate("ErrorResponse", err)["ok"], (path, err)
        else:
            assert shape(cpu_body) == shape(vllm_body), (method, path, got)


RESPONSES_BODIES: list[dict[str, Any]] = [  # what the OpenAI SDKs send to /v1/responses
    {"input": "hi", "max_output_tokens": 3, "temperature": 0},
    {
        "instructions": "Be brief.",
        "input": [
            {"role": "user", "content": [{"type": "input_text", "text": "hi"}]},
            {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": "ok"},
        ],
        "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}}],
        "tool_choice": "auto",
        "parallel_tool_calls": False,
        "max_output_tokens": 3,
        "include": [],
        "store": True,
    },
]


async def test_responses_requests_and_answers_validate_as_vllm_models(
    server_factory, vllm_contract: VllmContract
) -> None:
    """A request the CPU server answers on /v1/responses is one vLLM's ResponsesRequest accepts,
    and the Response it returns is vLLM's ResponsesResponse, declaring no field vLLM lacks."""
    server = await server_factory()
    for body in RESPONSES_BODIES:
        assert vllm_contract.validate("ResponsesRequest", body)["ok"], body
        status, data = await post(server.url + "/v1/responses", body)
        assert status == 200, data
        assert vllm_contract.validate("ResponsesResponse", data) == {"ok": True, "extra": []}
    refused = {"input": "hi", "text": {"format": {"type": "json_object"}}}
    assert vllm_contract.validate("ResponsesRequest", refused)["ok"]  # vLLM guides it; we refuse
    status, error = await post(server.url + "/v1/responses", refused)
    assert status == 400 and vllm_contract.validate("ErrorResponse", error)["ok"]


def test_every_responses_output_item_validates_as_vllm_models(vllm_contract: VllmContract) -> None:
    """Reasoning, message and function_call items (a random model writes none of the calls)."""
    from inference.openai.responses_api import ResponsesRequest, response_body

    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    message = {"role": "assistant", "content": "ok", "reasoning": "hm", "tool_calls": [call]}
    chat = {
        "model": "m",
        "choices": [{"index": 0, "message": message, "finish_reason": "tool_calls"}],
        "usage": {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7},
    }
    req = ResponsesRequest.model_validate({"input": "hi", "max_output_tokens": 9})
    data = response_body(req, chat, "resp_1")
    assert [i["type"] for i in data["output"]] == ["reasoning", "message", "function_call"]
    assert vllm_contract.validate("ResponsesResponse", data) == {"ok": True, "extra": []}
