"""The engine-free OpenAI pieces: incremental text and stop strings, tool-call extraction and
stream hold-back, template messages, response shapes, and the no-torch seam."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from inference.openai.errors import ApiError
from inference.openai.models import ChatCompletionRequest, Message
from inference.openai.render import template_messages
from inference.openai.responses import (
    Generated,
    OutputFormat,
    StreamHead,
    chat_choice,
    chat_chunk,
    chat_completion_body,
    chat_finish_reason,
    chat_logprobs,
    chat_stream_choice,
    legacy_logprobs,
    usage,
    usage_chunk,
    version_spans,
)
from inference.openai.schema import ChatCompletionResponse, ChatDelta
from inference.openai.sse import sse_event
from inference.openai.stream import ChatChoiceStream
from inference.openai.text import ChoiceText
from inference.openai.tools import ParsedMessage, call_syntax_start, extract_tool_calls


def byte_decode(ids) -> str:
    """The tiny model's tokenizer in miniature: one token per byte."""
    return bytes(ids).decode("utf-8", errors="replace")


def feed_all(text: ChoiceText, data: bytes, *, final: bool = True) -> list[str]:
    """Feed `data` one byte-token at a time; return what take() handed out after each."""
    pieces = []
    for n in range(1, len(data) + 1):
        text.feed(list(data[:n]), final=final and n == len(data))
        pieces.append(text.take(final=final and n == len(data)))
        if text.stopped:
            break
    return pieces


def test_a_character_split_across_byte_tokens_is_emitted_whole() -> None:
    text = ChoiceText(byte_decode)
    pieces = feed_all(text, "aé✓".encode())
    assert "".join(pieces) == text.text == "aé✓"
    assert "\ufffd" not in "".join(pieces)
    assert pieces[1] == ""  # first byte of é: held until the second arrives


def test_a_stop_string_spanning_tokens_cuts_the_text_and_is_never_streamed() -> None:
    text = ChoiceText(byte_decode, stop=("STOP", "zz"))
    pieces = feed_all(text, b"hello STOP world")
    assert text.stopped == "STOP" and text.text == "hello "
    assert "".join(pieces) == "hello "
    assert all("S" not in p for p in pieces)  # the possible stop prefix was held back


@settings(max_examples=60, deadline=None)
@given(
    st.binary(max_size=40),
    st.lists(st.text(alphabet="ab\u00e9", min_size=1, max_size=3), max_size=2),
)
def test_taken_pieces_concatenate_to_the_text_without_a_stop_string(data, stops) -> None:
    text = ChoiceText(byte_decode, stop=tuple(stops))
    pieces = feed_all(text, data)
    if not data:
        return
    assert "".join(pieces) == text.text
    assert not any(s in text.text for s in stops)
    full = byte_decode(list(data))
    if text.stopped is None:
        assert text.text == full
    else:
        assert full.startswith(text.text + text.stopped)


def test_extract_tool_calls_gives_openai_tool_calls_and_the_remaining_content() -> None:
    reply = 'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    parsed = extract_tool_calls(reply)
    assert parsed.content == "Checking."
    [call] = parsed.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    codegym = extract_tool_calls(
        '<|FunctionCallBegin|>[{"name": "f", "parameters": {}}]<|FunctionCallEnd|>'
    )
    assert [c.function.name for c in codegym.tool_calls] == ["f"] and codegym.content is None


def test_a_malformed_call_stays_plain_content() -> None:
    reply = "<tool_call>{not json}</tool_call>"
    assert extract_tool_calls(reply).tool_calls == []
    assert extract_tool_calls(reply).content == reply
    assert extract_tool_calls("just words").tool_calls == []


def test_call_syntax_start_holds_back_openers_and_their_prefixes() -> None:
    assert call_syntax_start("plain words") == len("plain words")
    assert call_syntax_start("ok <tool_call>{") == 3
    assert call_syntax_start("ok <tool_") == 3  # may grow into an opener
    assert call_syntax_start("ok <|FunctionCallB") == 3
    assert call_syntax_start('  {"name"') == 0  # may be a bare JSON call
    assert call_syntax_start("``") == 0


def test_streamed_chat_content_and_calls_match_the_non_streamed_message() -> None:
    reply = 'Checking.\n<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>'
    stream = ChatChoiceStream(ChoiceText(byte_decode), parse_tools=True)
    sent = []
    data = reply.encode()
    for n in range(1, len(data) + 1):
        stream.text.feed(list(data[:n]), final=n == len(data))
        sent.append(stream.content_delta())
    delta, calls = stream.final_delta()
    assert calls and "".join(sent) + (delta.content or "") == "Checking."
    assert [(c.index, c.function.name) for c in delta.tool_calls] == [(0, "f")]
    # a chunk dumped as vLLM dumps it (exclude_unset) still names the call's type
    assert delta.model_dump(exclude_unset=True)["tool_calls"][0]["type"] == "function"


def test_template_messages_decode_tool_call_arguments_and_join_text_parts() -> None:
    req = ChatCompletionRequest.model_validate(
        {
            "messages": [
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                },
                {
                    "role": "assistant",
                    "tool_calls": [
                        {
                            "id": "c",
                            "type": "function",
                            "function": {"name": "f", "arguments": '{"x": 1}'},
                        }
                    ],
                },
                {"role": "tool", "tool_call_id": "c", "content": "42"},
            ]
        }
    )
    user, assistant, tool = template_messages(req.messages)
    assert user["content"] == "ab"
    assert assistant["tool_calls"][0]["function"]["arguments"] == {"x": 1}
    assert tool == {"role": "tool", "content": "42", "tool_call_id": "c"}


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (
            {"messages": [{"role": "user", "content": "x"}], "tool_choice": "required"},
            "tool_choice",
        ),
        ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
        (
            {"messages": [{"role": "user", "content": "x"}], "presence_penalty": 0.5},
            "presence_penalty",
        ),
    ],
)
def test_unsupported_fields_are_refused_by_name(body, param) -> None:
    with pytest.raises(ApiError) as info:
        ChatCompletionRequest.model_validate(body)
    assert info.value.param == param and info.value.status == 400


def test_a_user_message_without_content_is_invalid() -> None:
    with pytest.raises(ValueError, match="needs content"):
        Message.model_validate({"role": "user"})


def test_response_pieces() -> None:
    spans = version_spans(["3", "3", "4"], offset=5)
    assert [s.model_dump() for s in spans] == [
        {"version": "3", "start": 5, "end": 7},
        {"version": "4", "start": 7, "end": 8},
    ]
    assert chat_finish_reason("stop", True) == "tool_calls"
    assert chat_finish_reason("length", True) == "length"
    gen = Generated([104, 105], [-1.0, float("-inf")], [[(1, -0.5)], [(2, -0.1)]], ["0", "0"])
    fmt = OutputFormat(token_text=chr, logprobs=True, top_logprobs=1)
    block = legacy_logprobs(gen, fmt)
    assert block.text_offset == [0, 1] and block.token_logprobs == [-1.0, -9999.0]
    assert block.top_logprobs == [{"h": -1.0, "\x01": -0.5}, {"i": -9999.0, "\x02": -0.1}]
    [first, _] = chat_logprobs(gen, fmt).content
    assert (first.token, first.bytes, [t.token for t in first.top_logprobs]) == (
        "h",
        [104],
        ["\x01"],
    )


@pytest.mark.parametrize("with_calls", [False, True])
@pytest.mark.parametrize("logprobs,token_ids,versions", [(False, False, False), (True, True, True)])
def test_the_endpoints_completion_dict_is_what_the_model_dumps(
    with_calls, logprobs, token_ids, versions
) -> None:
    """The agent endpoint builds its JSON answer without pydantic: the dict must validate as
    ChatCompletionResponse and equal that model's own dump, every field and type."""
    text = 'Let me look. <tool_call>{"name": "run", "arguments": {"code": "1"}}</tool_call>'
    parsed = extract_tool_calls(text) if with_calls else ParsedMessage("plain reply", [], "why")
    gen = Generated([72, 105, 2], [-0.5, float("-inf"), -1.0], [(), (), ()], ["3", "3", "4"])
    fmt = OutputFormat(byte_decode, logprobs, 0, token_ids, versions)
    body = chat_completion_body(
        "policy",
        parsed,
        gen,
        fmt,
        finish_reason="stop",
        prompt_ids=[1, 2] if token_ids else None,
        prompt_tokens=2,
    )
    model = ChatCompletionResponse(
        id=body["id"],
        created=body["created"],
        model="policy",
        choices=[chat_choice(0, parsed, gen, fmt, finish_reason="stop", stop_reason=None)],
        usage=usage(2, 3),
        prompt_token_ids=[1, 2] if token_ids else None,
    )
    assert json.loads(json.dumps(body)) == model.model_dump(mode="json")
    assert ChatCompletionResponse.model_validate(body) == model
    assert body["choices"][0]["finish_reason"] == ("tool_calls" if with_calls else "stop")


def test_stream_chunks_carry_only_what_they_set() -> None:
    head = StreamHead("m")
    opening = chat_chunk(head, [chat_stream_choice(0, ChatDelta(role="assistant", content=""))])
    wire = json.loads(sse_event(opening)[len(b"data: ") :])
    assert wire["object"] == "chat.completion.chunk" and wire["id"] == head.id
    assert wire["choices"] == [
        {
            "index": 0,
            "delta": {"role": "assistant", "content": ""},
            "logprobs": None,
            "finish_reason": None,
        }
    ]
    usage_only = json.loads(sse_event(usage_chunk(head, usage(3, 4)))[len(b"data: ") :])
    assert usage_only["choices"] == [] and usage_only["usage"]["total_tokens"] == 7


def test_the_openai_package_imports_neither_torch_nor_the_engine() -> None:
    code = (
        "import sys, inference.openai.models, inference.openai.render, inference.openai.tools, "
        "inference.openai.responses, inference.openai.sse, inference.openai.stream, "
        "inference.openai.schema; "
        "print(sorted(m for m in ('torch', 'inference.engine', 'transformers') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
