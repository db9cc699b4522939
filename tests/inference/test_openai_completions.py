"""`/v1/completions` through the `openai` SDK: text prompts, batches, stop strings, streaming; and
the workers' token path, which must stay on its own handler."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

import openai
import pytest

from inference.openai_completions import wants_openai_path

LETTERS = list(range(97, 123))


@pytest.fixture
async def sdk() -> AsyncIterator[Callable[[str], openai.AsyncOpenAI]]:
    made: list[openai.AsyncOpenAI] = []

    def make(url: str) -> openai.AsyncOpenAI:
        made.append(
            openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
        )
        return made[-1]

    yield make
    for api in made:
        await api.close()


def test_the_workers_token_body_stays_on_the_token_path() -> None:
    worker = {"prompt": [1, 2, 3], "return_token_ids": True, "logprobs": 1, "stop": None}
    assert not wants_openai_path(worker)
    assert not wants_openai_path(worker | {"stream": False, "stop": []})
    assert wants_openai_path(worker | {"stream": True})
    assert wants_openai_path(worker | {"stop": ["\n"]})
    assert wants_openai_path({"prompt": "text"}) and wants_openai_path({"prompt": [[1], [2]]})


async def test_text_prompts_and_batches(server_factory, sdk) -> None:
    server = await server_factory()
    api = sdk(server.url)
    extra = {"return_token_ids": True, "ignore_eos": True, "return_weight_versions": True}
    one = await api.completions.create(
        model=server.state.model_name, prompt="héllo", max_tokens=4, extra_body=extra
    )
    [choice] = one.choices
    assert choice.model_extra["prompt_token_ids"] == list("héllo".encode())
    assert len(choice.model_extra["token_ids"]) == 4 and choice.finish_reason == "length"
    assert choice.model_extra["weight_versions"] == [{"version": "0", "start": 0, "end": 4}]
    assert one.usage.prompt_tokens == 6 and one.usage.completion_tokens == 4
    batch = await api.completions.create(
        model=server.state.model_name,
        prompt=["ab", "xyz"],
        n=2,
        max_tokens=3,
        seed=5,
        logprobs=2,
        extra_body=extra,
    )
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]  # prompt p, choice j -> p * n + j
    prompts = [c.model_extra["prompt_token_ids"] for c in batch.choices]
    assert prompts == [list(b"ab")] * 2 + [list(b"xyz")] * 2
    assert batch.usage.prompt_tokens == 5 and batch.usage.completion_tokens == 12
    for c in batch.choices:
        assert len(c.logprobs.token_logprobs) == 3 and all(
            len(t) >= 2 for t in c.logprobs.top_logprobs
        )
    ids = await api.completions.create(
        model=server.state.model_name, prompt=[[104, 105]], max_tokens=2, extra_body=extra
    )
    assert ids.choices[0].model_extra["prompt_token_ids"] == [104, 105]


async def test_streamed_completions_equal_the_whole_ones(server_factory, sdk) -> None:
    server = await server_factory()
    api = sdk(server.url)
    kwargs: dict[str, Any] = {
        "model": server.state.model_name,
        "n": 2,
        "seed": 11,
        "max_tokens": 12,
        "logprobs": 0,
        "extra_body": {"ignore_eos": True, "allowed_token_ids": LETTERS},
    }
    for prompt in ("spell: ", [115, 112]):
        whole = await api.completions.create(prompt=prompt, **kwargs)
        options = {"include_usage": True, "continuous_usage_stats": True}
        stream = await api.completions.create(
            prompt=prompt, stream=True, stream_options=options, **kwargs
        )
        chunks = [chunk async for chunk in stream]
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 24
        running = [c.usage.completion_tokens for c in chunks[:-1]]
        assert running == sorted(running) and 0 < running[0] < 24  # usage on every chunk
        for choice in whole.choices:
            mine = [
                c.choices[0] for c in chunks if c.choices and c.choices[0].index == choice.index
            ]
            assert "".join(c.text for c in mine) == choice.text and len(choice.text) == 12
            assert sum(len(c.logprobs.tokens) for c in mine) == 12
            assert [c.finish_reason for c in mine if c.finish_reason] == ["length"]


async def test_stop_strings_on_text_completions(server_factory, sdk) -> None:
    server = await server_factory()
    api = sdk(server.url)
    base: dict[str, Any] = {
        "model": server.state.model_name,
        "prompt": "go",
        "temperature": 0,
        "max_tokens": 25,
        "extra_body": {"ignore_eos": True, "allowed_token_ids": LETTERS, "return_token_ids": True},
    }
    full = (await api.completions.create(**base)).choices[0].text
    stop = full[10:12]
    cut = full[: full.find(stop)]
    [choice] = (await api.completions.create(**base, stop=stop)).choices
    assert choice.text == cut and choice.finish_reason == "stop"
    assert choice.model_extra["stop_reason"] == stop
    assert len(choice.model_extra["token_ids"]) == len(cut) + len(stop)


BAD_TEXT = [
    ({"prompt": ""}, "prompt"),
    ({"prompt": [[]]}, "prompt"),
    ({"prompt": ["a", 5]}, "prompt.1"),
    ({"prompt": "a", "max_tokens": 10**9}, "max_tokens"),
    ({"prompt": "a", "echo": True}, "echo"),
    ({"prompt": "a", "suffix": "z"}, "suffix"),
    ({"prompt": "a", "logprobs": 21}, "logprobs"),
    ({"prompt": [[1, 10**6]]}, "prompt"),
    ({"prompt": "a", "stream": True, "n": 0}, "n"),
]


async def test_bad_text_completions_get_400(server_factory, sdk) -> None:
    server = await server_factory()
    api = sdk(server.url)
    for body, param in BAD_TEXT:
        fields = dict(body)
        with pytest.raises(openai.BadRequestError) as info:
            await api.completions.create(
                model=server.state.model_name, prompt=fields.pop("prompt"), extra_body=fields
            )
        assert info.value.body["param"] == param and info.value.body["code"] == 400, body
    ok = await api.completions.create(model=server.state.model_name, prompt="a", max_tokens=1)
    assert len(ok.choices) == 1
