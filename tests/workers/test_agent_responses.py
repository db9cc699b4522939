"""The worker endpoint's `/v1/responses`, driven by the real OpenAI Agents SDK (`openai-agents`)
with a function tool, unchanged: the agent's calls are recorded exactly as the equivalent chat
completions, in one segment, and stored responses belong to their episode only.

The tool model (`tool_model_dir`, from the inference tests) calls `get_weather` after ASK and
answers after its result, so the SDK's tool loop runs for real."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.inference.test_openai_chat import ANSWER, ASK, CALL, RESULT, TOOLS, tool_model_dir
from tests.inference.test_tool_choice import OPENERS, forced_model_dir
from tests.workers.agent_helpers import call_prompts, open_episode, render, serving

__all__ = ["forced_model_dir", "tool_model_dir"]  # fixtures, used by name

# The Agents SDK is in the dev extra (locks/cpu.txt); an environment without it skips, and CI,
# where a skip fails, says so.
pytest.importorskip("agents", reason="openai-agents is not installed (scripts/bootstrap.sh)")
from agents import (
    Agent,
    FunctionTool,
    ModelSettings,
    OpenAIResponsesModel,
    RunConfig,
    Runner,
    set_tracing_disabled,
)

set_tracing_disabled(True)  # the SDK would otherwise export traces to OpenAI's servers


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir: Path) -> Path:
    """The base model `tool_model_dir` fine-tunes."""
    return tiny_model_dir


def weather_agent(api: openai.AsyncOpenAI, asked: list[dict[str, Any]]) -> Agent[Any]:
    """An SDK agent with TOOLS' `get_weather` as a function tool that notes its arguments."""

    async def get_weather(_ctx: Any, arguments: str) -> str:
        asked.append(json.loads(arguments))
        return RESULT["content"]

    spec = TOOLS[0]["function"]
    tool = FunctionTool(
        name=spec["name"],
        description=spec["description"],
        params_json_schema=spec["parameters"],
        on_invoke_tool=get_weather,
        strict_json_schema=False,
    )
    model = OpenAIResponsesModel(model="policy", openai_client=api)
    return Agent(
        name="weather",
        model=model,
        tools=[tool],
        model_settings=ModelSettings(temperature=0, max_tokens=300),
    )


@pytest.mark.slow  # fine-tunes the tool model once per session
@pytest.mark.parametrize("streamed", [False, True])
async def test_agents_sdk_tool_agent_runs_unchanged_and_is_recorded_exactly(
    tool_model_dir: Path, streamed: bool
) -> None:
    asked: list[dict[str, Any]] = []
    async with serving(tool_model_dir) as endpoint:
        record, _, sdk = open_episode(endpoint)
        async with sdk() as api:
            agent = weather_agent(api, asked)
            question = ASK[0]["content"]
            config = RunConfig(tracing_disabled=True)
            if streamed:
                run = Runner.run_streamed(agent, question, run_config=config)
                _ = [event async for event in run.stream_events()]
            else:
                run = await Runner.run(agent, question, run_config=config)
    assert run.final_output == ANSWER and asked == [{"city": "Paris"}]
    # Two calls in one segment, each prompt the fresh rendering of the equivalent chat body.
    assert len(record.turns) == 2 and record.segments == 1
    call = CALL | {"tool_calls": [CALL["tool_calls"][0] | {"id": "any"}]}
    history = [*ASK, call, RESULT | {"tool_call_id": "any"}]
    bodies = [{"messages": ASK, "tools": TOOLS}, {"messages": history, "tools": TOOLS}]
    assert call_prompts(record.turns) == [render(endpoint, b) for b in bodies]


@pytest.mark.slow
async def test_previous_response_id_is_the_episodes_own(tool_model_dir: Path) -> None:
    flat = [{"type": "function", **TOOLS[0]["function"]}]
    async with serving(tool_model_dir) as endpoint:
        record, _, sdk = open_episode(endpoint)
        _, _, neighbour = open_episode(endpoint, name="t/1")
        async with sdk() as api, neighbour() as other:
            first = await api.responses.create(
                model="m", input=ASK, tools=flat, temperature=0, max_output_tokens=300
            )
            call = first.output[-1]
            result = {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}
            with pytest.raises(openai.NotFoundError):  # another episode's key: not found
                await other.responses.create(
                    model="m", input=[result], previous_response_id=first.id, tools=flat
                )
            second = await api.responses.create(
                model="m",
                input=[result],
                previous_response_id=first.id,
                tools=flat,
                temperature=0,
                max_output_tokens=300,
            )
    assert second.output_text == ANSWER
    assert [t.segment_start for t in record.turns] == [False, False] and record.segments == 1
    assert second.usage.output_tokens == len(record.turns[1].completion_ids)


async def test_structured_outputs_are_refused_by_name(tiny_model_dir: Path) -> None:
    """Structured outputs (no guided decoding here) get a 400 naming the field, on both APIs,
    and record nothing."""
    schema = {"format": {"type": "json_schema", "name": "a", "schema": {"type": "object"}}}
    async with serving(tiny_model_dir) as endpoint:
        record, _, sdk = open_episode(endpoint)
        async with sdk() as api:
            calls = [
                api.chat.completions.create(
                    model="m", messages=ASK, response_format={"type": "json_object"}
                ),
                api.responses.create(model="m", input="hi", text=schema),
            ]
            params = []
            for call in calls:
                with pytest.raises(openai.BadRequestError) as info:
                    await call
                params.append(info.value.body["param"])
    assert params == ["response_format", "text"]
    assert record.turns == [] and record.calls == 0


@pytest.mark.slow  # fine-tunes the tool model, then the forced one, once per session
async def test_forced_tool_choice_is_enforced_and_its_opener_is_prompt(
    forced_model_dir: Path,
) -> None:
    """`required` (chat) and a named function (Responses) start the model's call; the opener
    is in the recorded prompt, the recorded completion is exactly the sampled ids."""
    flat = [{"type": "function", **TOOLS[0]["function"]}]
    async with serving(forced_model_dir) as endpoint:
        record, _, sdk = open_episode(endpoint)
        async with sdk() as api:
            chat = await api.chat.completions.create(
                model="m",
                messages=ASK,
                tools=TOOLS,
                tool_choice="required",
                temperature=0,
                max_tokens=100,
                extra_body={"return_token_ids": True},
            )
            named = await api.responses.create(
                model="m",
                input=ASK,
                tools=flat,
                tool_choice={"type": "function", "name": "get_weather"},
                temperature=0,
                max_output_tokens=100,
            )
    [call] = chat.choices[0].message.tool_calls
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    assert not chat.choices[0].message.content
    assert [i.type for i in named.output] == ["function_call"]
    assert json.loads(named.output[0].arguments) == {"city": "Paris"}
    first, second = record.turns
    assert list(first.completion_ids) == chat.choices[0].model_extra["token_ids"]
    for turn, opener in ((first, OPENERS["required"]), (second, OPENERS["named"])):
        ids = endpoint.codec.encode_control(opener)
        assert list(turn.prompt_ids[-len(ids) :]) == ids  # the opener: prompt, loss mask 0
        text = endpoint.codec.decode(turn.completion_ids, skip_special=False)
        assert not text.startswith("<tool_call>")  # sampled: the call's rest only


def test_the_docs_agents_sdk_example_defines_a_tool_and_an_agent_function() -> None:
    """docs/envs.md's Agents SDK example imports and defines what its spec names."""
    import inspect
    import re

    docs = (Path(__file__).resolve().parents[2] / "docs" / "envs.md").read_text()
    section = docs.split("### The OpenAI Agents SDK", 1)[1].split("\n### ", 1)[0]
    [code] = re.findall(r"```python\n(.*?)```", section, re.DOTALL)
    namespace: dict[str, Any] = {}
    exec(compile(code, "docs/envs.md", "exec"), namespace)
    assert isinstance(namespace["add"], FunctionTool) and namespace["add"].name == "add"
    assert inspect.iscoroutinefunction(namespace["sdk_agent"])
    assert "my_agents:sdk_agent" in section
