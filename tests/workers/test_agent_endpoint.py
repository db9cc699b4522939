"""The worker's token-capturing OpenAI endpoint, driven by the real `openai` SDK against a real
CPU policy server: shapes, tool calls, streaming, exact recording, segments, limits, keys.

Tool calls need a model that makes them: `tool_model_dir` (from the inference tests) is the
tiny model fine-tuned until greedy decoding writes a `get_weather` call after ASK and an answer
after the tool's result."""

from __future__ import annotations

import asyncio
import json
import random
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest

from broker.messages import Truncation
from tests.inference.test_openai_chat import ANSWER, ASK, RESULT, TOOLS, tool_model_dir
from tests.workers.agent_helpers import call_prompts, open_episode, render, serving
from workers.agent_record import AgentLimits

__all__ = ["tool_model_dir"]  # a fixture, used by name


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir: Path) -> Path:
    """The base model `tool_model_dir` fine-tunes."""
    return tiny_model_dir


@pytest.mark.slow  # fine-tunes the tool model once per session (tens of seconds)
async def test_tool_calls_continue_one_segment_with_exact_tokens(tool_model_dir: Path) -> None:
    async with serving(tool_model_dir) as endpoint:
        record, _, sdk = open_episode(endpoint)
        async with sdk() as api:
            extra = {"return_token_ids": True}
            first = await api.chat.completions.create(
                model="any-name",
                messages=ASK,
                tools=TOOLS,
                temperature=0,
                max_tokens=300,
                extra_body=extra,
            )
            choice = first.choices[0]
            assert choice.finish_reason == "tool_calls" and choice.message.content == "Checking."
            [call] = choice.message.tool_calls
            assert call.function.name == "get_weather"
            assert json.loads(call.function.arguments) == {"city": "Paris"}
            history = [*ASK, choice.message.model_dump(exclude_none=True), RESULT]
            history[-1] = RESULT | {"tool_call_id": call.id}
            second = await api.chat.completions.create(
                model="any-name",
                messages=history,
                tools=TOOLS,
                temperature=0,
                max_tokens=300,
                extra_body=extra,
            )
        assert second.choices[0].message.content == ANSWER
        assert [t.segment_start for t in record.turns] == [False, False] and record.segments == 1
        # Recorded completions are the sampled ids; each call's prompt is its fresh rendering.
        sampled = [first.choices[0].token_ids, second.choices[0].token_ids]
        assert [list(t.completion_ids) for t in record.turns] == sampled
        bodies = [{"messages": ASK, "tools": TOOLS}, {"messages": history, "tools": TOOLS}]
        assert call_prompts(record.turns) == [render(endpoint, b) for b in bodies]
        assert len(record.turns[1].prompt_ids) < len(
            record.turns[0].prompt_ids
        )  # only the new part
        assert first.usage.completion_tokens == len(record.turns[0].completion_ids)


@pytest.mark.slow
async def test_streamed_tool_call_equals_the_whole_reply(tool_model_dir: Path) -> None:
    async with serving(tool_model_dir) as endpoint:
        record, _, sdk = open_episode(endpoint)
        async with sdk() as api:
            stream = await api.chat.completions.create(
                model="m",
                messages=ASK,
                tools=TOOLS,
                temperature=0,
                stream=True,
                max_tokens=300,
                stream_options={"include_usage": True},
            )
            chunks = [chunk async for chunk in stream]
    choices = [c.choices[0] for c in chunks if c.choices]
    content = "".join(c.delta.content or "" for c in choices)
    calls = [t for c in choices for t in (c.delta.tool_calls or [])]
    assert content == "Checking." and choices[-1].finish_reason == "tool_calls"
    assert [c.function.name for c in calls] == ["get_weather"]
    assert chunks[-1].usage.completion_tokens == len(record.turns[0].completion_ids)


async def test_sync_sdk_from_a_thread_is_recorded(tiny_model_dir: Path) -> None:
    async with serving(tiny_model_dir) as endpoint:
        record, key, _ = open_episode(endpoint)

        def agent() -> Any:
            with openai.OpenAI(base_url=endpoint.base_url, api_key=key, max_retries=0) as api:
                models = api.models.list()
                reply = api.chat.completions.create(
                    model=models.data[0].id,
                    messages=[{"role": "user", "content": "hi"}],
                    max_tokens=5,
                    logprobs=True,
                )
                return reply

        reply = await asyncio.to_thread(agent)
    [turn] = record.turns
    assert reply.usage.completion_tokens == len(turn.completion_ids) <= 5
    got = [entry.logprob for entry in reply.choices[0].logprobs.content]
    assert got == pytest.approx([float(v) for v in turn.logprobs], abs=1e-5)


async def test_unknown_or_expired_key_is_401_and_records_nothing(tiny_model_dir: Path) -> None:
    async with serving(tiny_model_dir) as endpoint:
        record, key, sdk = open_episode(endpoint)
        hi = [{"role": "user", "content": "hi"}]
        async with openai.AsyncOpenAI(
            base_url=endpoint.base_url, api_key="ep-guessed", max_retries=0
        ) as stranger:
            with pytest.raises(openai.AuthenticationError):
                await stranger.chat.completions.create(model="m", messages=hi)
            with pytest.raises(openai.AuthenticationError):
                await stranger.models.list()
        assert record.calls == 0 and record.turns == []
        endpoint.close_episode(key)
        async with sdk() as api:
            with pytest.raises(openai.AuthenticationError):
                await api.chat.completions.create(model="m", messages=hi)
        assert record.calls == 0 and record.turns == []


async def test_bad_requests_get_openai_errors(tiny_model_dir: Path) -> None:
    async with serving(tiny_model_dir) as endpoint:
        record, key, sdk = open_episode(endpoint)
        url, auth = endpoint.base_url + "/chat/completions", {"Authorization": f"Bearer {key}"}
        async with aiohttp.ClientSession(headers=auth) as http:
            for raw in (b"{not json", b"[1]", b'{"messages": []}'):
                async with http.post(url, data=raw) as resp:
                    body = await resp.json()
                    assert resp.status == 400 and body["error"]["code"] == 400
        async with sdk() as api:
            with pytest.raises(openai.BadRequestError, match="n must be 1"):
                await api.chat.completions.create(
                    model="m", messages=[{"role": "user", "content": "x"}], n=2
                )
            with pytest.raises(openai.BadRequestError, match="ignore_eos"):  # not ignored
                await api.chat.completions.create(
                    model="m",
                    messages=[{"role": "user", "content": "x"}],
                    extra_body={"ignore_eos": True},
                )
        assert record.turns == [] and record.calls == 0


def _next_messages(
    rng: random.Random, messages: list[dict[str, Any]], reply: str
) -> list[dict[str, Any]]:
    """An agent's next history: usually the reply and a new user message, sometimes an edit."""
    word = rng.choice(["ok", "again", "ünï ✓", "1 2 3", "<|im_end|>?"])
    move = rng.random()
    if move < 0.6:
        return [
            *messages,
            {"role": "assistant", "content": reply},
            {"role": "user", "content": word},
        ]
    if move < 0.8:  # summarise: keep the last user message only
        return [{"role": "system", "content": "summary " + word}, messages[-1]]
    return [{"role": "user", "content": word}]  # a sub-agent starting fresh


async def test_recorded_tokens_equal_a_fresh_rendering_of_every_call(tiny_model_dir: Path) -> None:
    """Property: over random agent histories (continued, edited, restarted), every call's prompt
    rebuilt from the recorded turns is the template's rendering of that call (with
    `--reasoning-history drop`, where every call is rendered whole)."""
    rng = random.Random(17)
    async with serving(tiny_model_dir, history="drop") as endpoint:
        record, _, sdk = open_episode(endpoint)
        bodies: list[dict[str, Any]] = []
        messages: list[dict[str, Any]] = [{"role": "user", "content": "start"}]
        async with sdk() as api:
            for _ in range(24):
                body = {"messages": messages, "max_tokens": rng.randint(1, 4)}
                reply = await api.chat.completions.create(model="m", **body)
                bodies.append(body)
                messages = _next_messages(rng, messages, reply.choices[0].message.content or "")
    assert call_prompts(record.turns) == [render(endpoint, b) for b in bodies]
    assert 1 < record.segments < len(bodies)  # both paths were taken
    assert sum(t.segment_start for t in record.turns) == record.segments - 1


PRINTABLE = {"allowed_token_ids": list(range(32, 127))}  # no stop token among them


async def test_limits_refuse_the_call_and_mark_truncation(tiny_model_dir: Path) -> None:
    hi = [{"role": "user", "content": "hi"}]
    cases = [
        (AgentLimits(1, 100, 4096, 60), Truncation.MAX_TURNS, 1),
        (AgentLimits(9, 3, 4096, 60), Truncation.TOKENS, 1),
        (AgentLimits(9, 100, 12, 60), Truncation.CONTEXT, 0),
    ]
    async with serving(tiny_model_dir) as endpoint:
        for limits, cause, calls_ok in cases:
            record, _, sdk = open_episode(endpoint, limits)
            async with sdk() as api:
                for _ in range(calls_ok):  # printable bytes only: an early EOS would leave
                    await api.chat.completions.create(  # the token budget unspent
                        model="m", messages=hi, max_tokens=8, extra_body=PRINTABLE
                    )
                with pytest.raises(openai.BadRequestError, match=cause.value):
                    await api.chat.completions.create(model="m", messages=hi, max_tokens=8)
            assert record.truncation is cause and len(record.turns) == calls_ok
            if calls_ok:
                assert record.turns[-1].truncated
        # the token budget also caps max_tokens of the call that still fits
        record, _, sdk = open_episode(endpoint, AgentLimits(9, 3, 4096, 60))
        async with sdk() as api:
            reply = await api.chat.completions.create(
                model="m", messages=hi, max_tokens=50, extra_body=PRINTABLE
            )
        assert reply.usage.completion_tokens == 3
