"""`POST /v1/responses` on the CPU policy server, driven by the real `openai` SDK: function
tools, multi-turn through `previous_response_id` and through passed input items, the event
stream, and the refusals (structured outputs, non-function tools, unknown responses)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.inference.test_openai_chat import ANSWER, ASK, TOOLS, sdk, tool_model_dir

__all__ = ["sdk", "tool_model_dir"]  # fixtures, used by name

FLAT_TOOLS = [{"type": "function", **TOOLS[0]["function"]}]  # the Responses API's tool shape


@pytest.mark.slow  # fine-tunes the tool model once per session
async def test_function_call_then_answer_through_previous_response_id(
    server_factory, sdk, tool_model_dir: Path
) -> None:
    server = await server_factory(model=tool_model_dir)
    api = sdk(server.url)
    common: dict[str, Any] = {"model": server.state.model_name, "temperature": 0}
    first = await api.responses.create(input=ASK, tools=FLAT_TOOLS, **common)
    assert [item.type for item in first.output] == ["message", "function_call"]
    assert first.output_text == "Checking." and first.status == "completed"
    call = first.output[1]
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"}
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}
    second = await api.responses.create(
        input=[result], previous_response_id=first.id, tools=FLAT_TOOLS, **common
    )
    assert second.output_text == ANSWER and [i.type for i in second.output] == ["message"]
    # The same turn with the whole conversation passed as input items instead.
    items = [*ASK, *[i.model_dump(exclude_none=True) for i in first.output], result]
    passed = await api.responses.create(input=items, tools=FLAT_TOOLS, **common)
    assert passed.output_text == ANSWER
    assert passed.usage.input_tokens == second.usage.input_tokens


@pytest.mark.slow
async def test_streamed_response_events_assemble_the_whole_response(
    server_factory, sdk, tool_model_dir: Path
) -> None:
    server = await server_factory(model=tool_model_dir)
    api = sdk(server.url)
    common: dict[str, Any] = {
        "model": server.state.model_name,
        "input": ASK,
        "tools": FLAT_TOOLS,
        "temperature": 0,
    }
    whole = await api.responses.create(**common)
    async with api.responses.stream(**common) as stream:
        kinds = [event.type async for event in stream]
        final = await stream.get_final_response()
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    assert "response.output_text.delta" in kinds
    assert "response.function_call_arguments.done" in kinds
    assert final.output_text == whole.output_text == "Checking."
    assert [(i.type, getattr(i, "arguments", None)) for i in final.output] == [
        (i.type, getattr(i, "arguments", None)) for i in whole.output
    ]


async def test_unsupported_requests_are_refused_with_the_reason(server_factory, sdk) -> None:
    server = await server_factory()
    api = sdk(server.url)
    schema = {"type": "object", "properties": {"a": {"type": "string"}}}
    structured = {"format": {"type": "json_schema", "name": "a", "schema": schema}}
    refusals = [
        ({"text": structured}, "structured outputs"),
        ({"tools": [{"type": "web_search"}]}, "only function tools"),
        ({"previous_response_id": "resp_nope"}, "unknown"),
        ({"input": [{"type": "image_generation_call", "id": "x"}]}, "not supported"),
        ({"tool_choice": "required"}, "tool_choice needs tools"),
    ]
    for extra, reason in refusals:
        body = {"input": "hi", "max_output_tokens": 2} | extra
        with pytest.raises(openai.APIStatusError) as info:
            await api.responses.create(**body)
        assert info.value.status_code in (400, 404)
        assert reason in info.value.message
    plain = await api.responses.create(input="hi", max_output_tokens=2, temperature=0)
    assert plain.status == "incomplete" and plain.usage.output_tokens == 2
