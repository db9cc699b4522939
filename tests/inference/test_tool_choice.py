"""A forced `tool_choice` on the CPU policy server: `required` and a named function start the
model's `<tool_call>` (inference.openai.tool_choice), the forced text is in the prompt ids and
the completion ids are only what was sampled; streamed replies equal whole ones."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import openai
import pytest
from transformers import AutoTokenizer

from inference.openai.errors import ApiError
from inference.openai.models import ChatCompletionRequest
from tests.inference.test_openai_chat import (
    ASK,
    CALL,
    TOOLS,
    fit_replies,
    render_ids,
    sdk,
    tool_model_dir,
)

__all__ = ["sdk", "tool_model_dir"]  # fixtures, used by name

NAMED = {"type": "function", "function": {"name": "get_weather"}}
OPENERS = {  # what each forced choice puts after the assistant cue
    "required": '<tool_call>\n{"name": "',
    "named": '<tool_call>\n{"name": "get_weather", "arguments": ',
}


@pytest.fixture(scope="module")
def forced_model_dir(tool_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tool model also trained to finish CALL's call after either forced opener (a model
    that was never shown that context writes noise there: the opener forces syntax, not
    sense)."""
    tokenizer = AutoTokenizer.from_pretrained(tool_model_dir)
    first = render_ids(tokenizer, ASK, True)
    call = render_ids(tokenizer, [*ASK, CALL], False)
    replies = [(first, call[len(first) :])]
    text = tokenizer.decode(call[len(first) :])
    start = text.index("<tool_call>")
    for opener in OPENERS.values():
        rest = text[start + len(opener) :].rstrip("\n")
        prompt = first + tokenizer.encode(opener, add_special_tokens=False)
        replies.append((prompt, tokenizer.encode(rest, add_special_tokens=False)))
    return fit_replies(tool_model_dir, replies, tmp_path_factory.mktemp("forced-model"))


@pytest.mark.slow  # fine-tunes the tool model once per session
@pytest.mark.parametrize("choice", ["required", NAMED])
async def test_forced_tool_choice_calls_and_keeps_forced_tokens_out_of_the_completion(
    server_factory, sdk, forced_model_dir: Path, choice: Any
) -> None:
    server = await server_factory(model=forced_model_dir)
    api = sdk(server.url)
    common: dict[str, Any] = {
        "model": server.state.model_name,
        "messages": ASK,
        "tools": TOOLS,
        "temperature": 0,
        "max_tokens": 100,
    }
    auto = await api.chat.completions.create(**common, extra_body={"return_token_ids": True})
    assert auto.choices[0].message.content == "Checking."  # unforced, the model talks first
    extra = {"return_token_ids": True}
    forced = await api.chat.completions.create(**common, tool_choice=choice, extra_body=extra)
    reply = forced.choices[0]
    assert reply.finish_reason == "tool_calls" and not reply.message.content
    [call] = reply.message.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    # The forced opener is prompt, not completion: what the learner trains was all sampled.
    tokenizer = AutoTokenizer.from_pretrained(forced_model_dir)
    opener = OPENERS["named" if choice == NAMED else "required"]
    opener_ids = tokenizer.encode(opener, add_special_tokens=False)
    prompt = forced.model_extra["prompt_token_ids"]
    assert prompt == [*auto.model_extra["prompt_token_ids"], *opener_ids]
    sampled = reply.model_extra["token_ids"]
    assert forced.usage.completion_tokens == len(sampled)
    assert tokenizer.decode([*opener_ids, *sampled]).startswith(opener)
    stream = await api.chat.completions.create(**common, tool_choice=choice, stream=True)
    chunks = [c.choices[0] async for c in stream if c.choices]
    assert "".join(c.delta.content or "" for c in chunks) == ""
    deltas = [t for c in chunks for t in (c.delta.tool_calls or [])]
    assert [(t.function.name, t.function.arguments) for t in deltas] == [
        (call.function.name, call.function.arguments)
    ]


async def test_forced_tool_choice_is_refused_where_the_template_has_no_call_syntax(
    server_factory, sdk
) -> None:
    server = await server_factory()
    server.state.tokenizer.chat_template = "{% for m in messages %}{{ m.content }}{% endfor %}"
    api = sdk(server.url)
    with pytest.raises(openai.BadRequestError) as info:
        await api.chat.completions.create(
            model=server.state.model_name, messages=ASK, tools=TOOLS, tool_choice="required"
        )
    assert info.value.status_code == 400 and "<tool_call>" in info.value.message


def test_a_named_choice_must_name_an_offered_tool() -> None:
    body = {"messages": ASK, "tools": TOOLS, "tool_choice": NAMED}
    assert ChatCompletionRequest.model_validate(body).tool_choice.function.name == "get_weather"
    with pytest.raises(ApiError, match="not among tools"):
        ChatCompletionRequest.model_validate(body | {"tool_choice": {"function": {"name": "x"}}})
