"""`/v1/chat/completions`, `/tokenize` and `/detokenize` of the CPU policy server, driven by the
official `openai` SDK (async, and sync from a worker thread or against `python -m inference`).

Tool calls need a model that makes them: `tool_model_dir` fine-tunes the tiny random model until
greedy decoding reproduces two replies (a `get_weather` call, then an answer from the tool's
result), so the tests see real generation, the real chat template and the real parsers."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
import torch
from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from prometheus_client import REGISTRY
from transformers import AutoModelForCausalLM, AutoTokenizer

from inference.openai.models import Message
from inference.openai.render import TokenizerRenderer, template_messages
from tests.inference.conftest import eventually, teacher_forced_logprobs

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather of a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
ASK = [{"role": "user", "content": "Weather in Paris?"}]
CALL = {
    "role": "assistant",
    "content": "Checking.",
    "tool_calls": [
        {
            "id": "c1",
            "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
        }
    ],
}
RESULT = {"role": "tool", "tool_call_id": "c1", "content": "sunny"}
ANSWER = "It is sunny."
LETTERS = list(range(97, 123))  # allowed_token_ids: readable replies from a random model


@pytest.fixture
async def sdk() -> AsyncIterator[Callable[[str], openai.AsyncOpenAI]]:
    """Async `openai` clients for a server URL, closed at the end of the test."""
    made: list[openai.AsyncOpenAI] = []

    def make(url: str) -> openai.AsyncOpenAI:
        made.append(
            openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
        )
        return made[-1]

    yield make
    for api in made:
        await api.close()


def render_ids(tokenizer: Any, messages: list[dict[str, Any]], generation: bool) -> list[int]:
    validated = [Message.model_validate(m) for m in messages]
    renderer = TokenizerRenderer(tokenizer)
    return renderer.render_messages(
        template_messages(validated), TOOLS, add_generation_prompt=generation
    )


@pytest.fixture(scope="module")
def tool_model_dir(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model trained until greedy decoding gives CALL after ASK and ANSWER after RESULT."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    first = render_ids(tokenizer, ASK, True)
    replies = [
        (first, render_ids(tokenizer, [*ASK, CALL], False)[len(first) :]),
        (render_ids(tokenizer, [*ASK, CALL, RESULT], True), [*tokenizer.encode(ANSWER), eos]),
    ]
    return fit_replies(model_dir, replies, tmp_path_factory.mktemp("tool-model"))


def fit_replies(model_dir: Path, replies: list[tuple[list[int], list[int]]], out: Path) -> Path:
    """The model at `model_dir` trained until greedy decoding gives each reply after its
    prompt, saved (with its tokenizer) to `out`."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # many threads on a loaded 2-core machine are ~10x slower here
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
            optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
            for _ in range(300):
                loss, exact = torch.zeros(()), True
                for prompt, reply in replies:
                    ids = torch.tensor([prompt + reply])
                    logits = model(ids).logits[0, len(prompt) - 1 : -1]
                    target = ids[0, len(prompt) :]
                    loss = loss + torch.nn.functional.cross_entropy(logits, target)
                    exact = exact and bool((logits.argmax(-1) == target).all())
                if exact:
                    break
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
    finally:
        torch.set_num_threads(threads)
    assert exact, "the tiny model did not learn the tool-call replies"
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


async def post(url: str, body: Any = None, raw: bytes | None = None) -> tuple[int, Any]:
    async with aiohttp.ClientSession() as s:
        kwargs: dict[str, Any] = {"data": raw} if raw is not None else {"json": body}
        async with s.post(url, timeout=aiohttp.ClientTimeout(total=60), **kwargs) as r:
            return r.status, await r.json(content_type=None)


async def test_chat_n_seed_and_logprobs_are_the_models(
    server_factory, sdk, model_dir: Path
) -> None:
    server = await server_factory()
    api = sdk(server.url)
    kwargs: dict[str, Any] = {
        "model": server.state.model_name,
        "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
        "n": 2,
        "seed": 7,
        "max_tokens": 12,
        "logprobs": True,
        "top_logprobs": 3,
        "extra_body": {
            "return_token_ids": True,
            "ignore_eos": True,
            "return_weight_versions": True,
        },
    }
    first, again = await asyncio.gather(
        api.chat.completions.create(**kwargs), api.chat.completions.create(**kwargs)
    )
    prompt = first.model_extra["prompt_token_ids"]
    status, tokenized = await post(server.url + "/tokenize", {"messages": kwargs["messages"]})
    assert status == 200 and tokenized["tokens"] == prompt
    assert first.usage.prompt_tokens == len(prompt) and first.usage.completion_tokens == 24
    tokens = [c.model_extra["token_ids"] for c in first.choices]
    assert tokens == [c.model_extra["token_ids"] for c in again.choices]  # seeded: repeats
    assert tokens[0] != tokens[1]  # choice i draws from seed + i
    for choice, ids in zip(first.choices, tokens, strict=True):
        assert choice.finish_reason == "length" and len(ids) == 12
        assert choice.model_extra["weight_versions"] == [{"version": "0", "start": 0, "end": 12}]
        entries = choice.logprobs.content
        got = torch.tensor([e.logprob for e in entries])
        assert float((got - teacher_forced_logprobs(model_dir, prompt, ids)).abs().max()) < 1e-4
        for entry in entries:
            tops = [t.logprob for t in entry.top_logprobs]
            assert (
                len(tops) == 3 and tops == sorted(tops, reverse=True) and entry.logprob <= tops[0]
            )


async def test_streamed_chat_equals_the_whole_reply(server_factory, sdk) -> None:
    server = await server_factory()
    api = sdk(server.url)
    kwargs: dict[str, Any] = {
        "model": server.state.model_name,
        "messages": [{"role": "user", "content": "spell"}],
        "n": 2,
        "seed": 3,
        "max_completion_tokens": 15,
        "max_tokens": 100,  # max_completion_tokens wins, as in vLLM
        "logprobs": True,
        "extra_body": {"ignore_eos": True, "allowed_token_ids": LETTERS},
    }
    whole = await api.chat.completions.create(**kwargs)
    stream = await api.chat.completions.create(
        **kwargs, stream=True, stream_options={"include_usage": True}
    )
    chunks = [chunk async for chunk in stream]
    assert [c.choices[0].delta.role for c in chunks[:2]] == ["assistant", "assistant"]
    for index, choice in enumerate(whole.choices):
        mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == index]
        assert "".join(c.delta.content or "" for c in mine) == choice.message.content
        streamed = [e.logprob for c in mine if c.logprobs for e in c.logprobs.content]
        # The second request reuses the first's prompt KV (prefix cache): equal to float rounding.
        assert streamed == pytest.approx([e.logprob for e in choice.logprobs.content], abs=1e-5)
        assert len(choice.message.content) == 15
        assert [c.finish_reason for c in mine if c.finish_reason] == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 30
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens


async def test_stop_strings_and_top_p(server_factory, sdk) -> None:
    server = await server_factory()
    api = sdk(server.url)
    base: dict[str, Any] = {
        "model": server.state.model_name,
        "messages": [{"role": "user", "content": "go"}],
        "temperature": 0,
        "max_tokens": 30,
        "extra_body": {"ignore_eos": True, "allowed_token_ids": LETTERS},
    }
    full = (await api.chat.completions.create(**base)).choices[0].message.content
    stop = full[12:14]
    cut = full[: full.find(stop)]
    reply = await api.chat.completions.create(**base, stop=[stop, "never"])
    assert reply.choices[0].message.content == cut
    assert reply.choices[0].finish_reason == "stop"
    assert reply.choices[0].model_extra["stop_reason"] == stop
    assert reply.usage.completion_tokens == len(cut) + len(stop)  # one byte token per letter
    nucleus = await api.chat.completions.create(**(base | {"temperature": 1.0, "top_p": 1e-9}))
    assert nucleus.choices[0].message.content == full  # a tiny nucleus keeps only the argmax
    stream = await api.chat.completions.create(**base, stop=stop, stream=True)
    assert "".join([c.choices[0].delta.content or "" async for c in stream if c.choices]) == cut


async def test_tool_calls_round_trip_through_the_sdk(
    server_factory, sdk, tool_model_dir: Path
) -> None:
    server = await server_factory(model=tool_model_dir)
    api = sdk(server.url)
    common: dict[str, Any] = {"model": server.state.model_name, "tools": TOOLS, "temperature": 0}
    reply = await api.chat.completions.create(messages=ASK, **common)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Checking."
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {
        "city": "Paris"
    }
    history = [
        *ASK,
        choice.message.model_dump(exclude_none=True),
        RESULT | {"tool_call_id": call.id},
    ]
    answer = await api.chat.completions.create(messages=history, **common)
    assert answer.choices[0].message.content == ANSWER
    assert answer.choices[0].finish_reason == "stop" and not answer.choices[0].message.tool_calls

    stream = await api.chat.completions.create(messages=ASK, stream=True, **common)
    chunks = [c.choices[0] async for c in stream if c.choices]
    assert "".join(c.delta.content or "" for c in chunks) == "Checking."
    deltas = [t for c in chunks for t in (c.delta.tool_calls or [])]
    assert [(t.index, t.function.name, json.loads(t.function.arguments)) for t in deltas] == [
        (0, "get_weather", {"city": "Paris"})
    ]
    assert chunks[-1].finish_reason == "tool_calls"

    async with api.chat.completions.stream(messages=ASK, **common) as helper:  # SDK assembly
        final = await helper.get_final_completion()
    [assembled] = final.choices[0].message.tool_calls
    assert (assembled.function.name, assembled.function.arguments) == (
        call.function.name,
        call.function.arguments,
    )
    assert final.choices[0].message.content == "Checking."

    plain = await api.chat.completions.create(messages=ASK, tool_choice="none", **common)
    assert plain.choices[0].message.tool_calls == []
    assert "<tool_call>" in plain.choices[0].message.content
    assert plain.choices[0].finish_reason == "stop"


async def test_tokenize_and_detokenize_as_vllm(server_factory, sdk) -> None:
    server = await server_factory()
    url = server.url
    status, body = await post(url + "/tokenize", {"prompt": "héllo", "return_token_strs": True})
    assert status == 200
    assert body["tokens"] == list("héllo".encode()) and body["count"] == 6
    assert body["max_model_len"] == server.state.engine.max_model_len
    assert len(body["token_strs"]) == 6
    status, body = await post(url + "/detokenize", {"tokens": body["tokens"]})
    assert status == 200 and body == {"prompt": "héllo"}
    status, body = await post(url + "/tokenize", {"messages": ASK, "tools": TOOLS})
    assert status == 200 and body["token_strs"] is None
    tokenizer = server.state.tokenizer
    assert body["tokens"] == render_ids(tokenizer, ASK, True)
    status, bare = await post(url + "/tokenize", {"messages": ASK, "add_generation_prompt": False})
    assert status == 200 and bare["count"] < body["count"]


BAD_CHAT = [
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages.0.role"),
    ({"messages": [{"role": "user"}]}, "messages.0"),
    (
        {
            "messages": [
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}
            ]
        },
        "messages.0.content.0.type",
    ),
    ({"top_logprobs": 3}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"n": 10_000}, "n"),
    ({"max_tokens": 10**9}, "max_tokens"),
    ({"max_completion_tokens": 0}, "max_completion_tokens"),
    ({"temperature": -1}, "temperature"),
    ({"top_p": 0}, "top_p"),
    (
        {"tool_choice": {"type": "function", "function": {"name": "nope"}}, "tools": TOOLS},
        "tool_choice",
    ),
    (
        {"tools": [{"type": "function", "function": {"description": "no name"}}]},
        "tools.0.function.name",
    ),
    ({"presence_penalty": 0.5}, "presence_penalty"),
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"stop_token_ids": [100_000]}, "stop_token_ids"),
    (
        {"stream": True, "stream_options": {"include_usage": "sometimes"}},
        "stream_options.include_usage",
    ),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"tools": []}, "tools"),
    ({"tool_choice": "auto"}, "tool_choice"),
]


async def test_bad_chat_requests_get_400_in_openai_shape(server_factory, sdk) -> None:
    server = await server_factory(max_n=4)
    api = sdk(server.url)
    base = {"model": server.state.model_name, "messages": ASK, "max_tokens": 2}
    for fields, param in BAD_CHAT:
        body = base | fields
        extra = {k: body.pop(k) for k in list(body) if k not in ("model", "messages")}
        with pytest.raises(openai.BadRequestError) as info:
            await api.chat.completions.create(
                model=body["model"], messages=body["messages"], extra_body=extra
            )
        error = info.value.body
        assert info.value.status_code == 400 and error["code"] == 400, fields
        assert error["type"] == "BadRequestError" and error["param"] == param, (fields, error)
    with pytest.raises(openai.NotFoundError) as info:
        await api.chat.completions.create(model="someone-else", messages=ASK)
    assert "does not exist" in info.value.body["message"]
    for raw in (b"{", b"[1]", b"\xff"):
        status, body = await post(server.url + "/v1/chat/completions", raw=raw)
        assert status == 400 and body["error"]["type"] == "BadRequestError", raw
    for route, body in (
        ("/tokenize", {"prompt": 5}),
        ("/detokenize", {"tokens": [-1]}),
        ("/detokenize", {"tokens": [10**6]}),
    ):
        status, data = await post(server.url + route, body)
        assert status == 400 and data["error"]["code"] == 400, (route, body)
    reply = await api.chat.completions.create(**base)  # still serving
    assert reply.choices[0].finish_reason in ("length", "stop")


async def test_a_client_leaving_a_stream_frees_its_sequence(server_factory, sdk) -> None:
    server = await server_factory()
    api = sdk(server.url)
    stream = await api.chat.completions.create(
        model=server.state.model_name,
        messages=ASK,
        max_tokens=3000,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            break
    await stream.close()
    await eventually(lambda: REGISTRY.get_sample_value("farm_inference_running_sequences") == 0)
    assert not server.state.engine._running


async def test_api_key_guards_the_openai_routes(server_factory, sdk) -> None:
    server = await server_factory(api_key="sesame")
    wrong = sdk(server.url)
    with pytest.raises(openai.AuthenticationError):
        await wrong.chat.completions.create(model=server.state.model_name, messages=ASK)
    right = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="sesame", max_retries=0)
    async with right:
        reply = await right.completions.create(
            model=server.state.model_name, prompt="a", max_tokens=1
        )
    assert reply.usage.completion_tokens == 1


@pytest.mark.slow
def test_sync_sdk_against_the_cli_server(process_factory) -> None:
    [proc] = process_factory(1)
    with openai.OpenAI(base_url=proc.url + "/v1", api_key="none", max_retries=0, timeout=60) as api:
        _sync_calls(api)


def _sync_calls(api: openai.OpenAI) -> None:
    [model] = api.models.list().data
    reply = api.chat.completions.create(
        model=model.id, messages=ASK, max_tokens=4, extra_body={"ignore_eos": True}
    )
    assert reply.choices[0].finish_reason == "length" and reply.usage.completion_tokens == 4
    with api.chat.completions.create(
        model=model.id, messages=ASK, max_tokens=4, stream=True
    ) as stream:
        assert next(c.object for c in stream) == "chat.completion.chunk"
    with pytest.raises(openai.BadRequestError):
        api.chat.completions.create(model=model.id, messages=[])


async def test_raw_bodies_validate_as_the_openai_types(
    server_factory, tool_model_dir: Path
) -> None:
    """The SDK builds its objects leniently; validating the raw JSON checks the wire shape."""
    server = await server_factory(model=tool_model_dir)
    body = {"messages": ASK, "tools": TOOLS, "temperature": 0, "n": 2, "logprobs": True}
    status, whole = await post(server.url + "/v1/chat/completions", body)
    assert status == 200
    parsed = ChatCompletion.model_validate(whole)
    assert parsed.choices[1].message.tool_calls[0].function.name == "get_weather"
    async with aiohttp.ClientSession() as session:
        stream = body | {"stream": True, "stream_options": {"include_usage": True}}
        async with session.post(server.url + "/v1/chat/completions", json=stream) as r:
            assert r.headers["Content-Type"].startswith("text/event-stream")
            events = (await r.text()).split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""]
    chunks = [
        ChatCompletionChunk.model_validate_json(e.removeprefix("data: ")) for e in events[:-2]
    ]
    assert {c.id for c in chunks} == {chunks[0].id} and chunks[-1].usage is not None
    status, text = await post(server.url + "/v1/completions", {"prompt": ["a", "b"], "logprobs": 1})
    assert status == 200 and len(Completion.model_validate(text).choices) == 2
