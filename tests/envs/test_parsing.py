"""Tool-call parsing: every syntax, malformed input, and a never-raises property."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from envs.parsing import parse_tool_calls
from envs.tools import ToolCall


def test_hermes_single_and_multiple() -> None:
    text = 'thinking <tool_call>{"name": "a", "arguments": {"x": 1}}</tool_call>\n<tool_call>{"name": "b", "arguments": "{\\"y\\": 2}"}</tool_call>'
    parsed = parse_tool_calls(text)
    assert parsed.error is None and parsed.syntax == "hermes"
    assert parsed.calls == (ToolCall("a", {"x": 1}), ToolCall("b", {"y": 2}))
    assert parsed.content == "thinking"


def test_codegym_syntax_with_list_and_openai_function_shape() -> None:
    text = '<|FunctionCallBegin|>[{"name": "Observe", "parameters": {}}, {"type": "function", "function": {"name": "Done", "arguments": {"answer": 3}}}]<|FunctionCallEnd|>'
    parsed = parse_tool_calls(text)
    assert parsed.error is None and parsed.syntax == "codegym"
    assert parsed.calls == (ToolCall("Observe", {}), ToolCall("Done", {"answer": 3}))


def test_bare_json_and_fenced_json() -> None:
    assert parse_tool_calls('{"name": "f", "arguments": {"q": "z"}}').calls == (
        ToolCall("f", {"q": "z"}),
    )
    fenced = '```json\n[{"name": "g", "parameters": {"n": 1}}]\n```'
    assert parse_tool_calls(fenced).calls == (ToolCall("g", {"n": 1}),)


def test_plain_text_is_content_not_error() -> None:
    for text in ["the answer is 4", "{not a call}", '{"x": 1}', "[1, 2]", ""]:
        parsed = parse_tool_calls(text)
        assert parsed.calls == () and parsed.error is None


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("<tool_call>{oops}</tool_call>", "invalid JSON"),
        ('<tool_call>{"name": "a"}', "unbalanced"),
        ('<tool_call>{"arguments": {}}</tool_call>', "non-empty string 'name'"),
        ('<tool_call>{"name": "a", "arguments": [1]}</tool_call>', "must be a JSON object"),
        ('<tool_call>{"name": "a", "arguments": "not json"}</tool_call>', "invalid JSON"),
        ("<tool_call>[]</tool_call>", "empty tool call list"),
        ("<tool_call>7</tool_call>", "must be a JSON object"),
        ('<|FunctionCallBegin|>[{"name": 5}]<|FunctionCallEnd|>', "non-empty string 'name'"),
        ("<|FunctionCallBegin|>[{]", "unbalanced"),
        ('{"name": "a", "arguments": {', "invalid JSON"),
        ('{"name": "", "arguments": {}}', "non-empty string 'name'"),
        ("<tool_call>" + "[" * 100_000 + "</tool_call>", "JSON"),
        (None, "must be text"),
        ("x" * 300_000, "longer than"),
    ],
)
def test_malformed_calls_are_errors(text: str, fragment: str) -> None:
    parsed = parse_tool_calls(text)
    assert parsed.calls == () and parsed.error is not None and fragment in parsed.error


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=5),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3)
    ),
    max_leaves=10,
)
fragments = st.sampled_from(
    [
        "<tool_call>",
        "</tool_call>",
        "<|FunctionCallBegin|>",
        "<|FunctionCallEnd|>",
        "{",
        "}",
        "[",
        "]",
        '"name"',
        '"arguments"',
        '"parameters"',
        ":",
        ",",
        '"',
        "```",
        "json",
        "\\",
    ]
)


@pytest.mark.slow
@settings(max_examples=400, deadline=None)
@given(st.lists(fragments | st.text(max_size=8) | json_values.map(json.dumps), max_size=12))
def test_parsing_never_raises(parts: list[str]) -> None:
    parsed = parse_tool_calls("".join(parts))
    assert parsed.error is None or parsed.calls == () or parsed.syntax != "json"
    for call in parsed.calls:
        assert isinstance(call.name, str) and call.name and isinstance(call.arguments, dict)


@settings(max_examples=200, deadline=None)
@given(
    st.text(min_size=1, max_size=12), st.dictionaries(st.text(max_size=6), json_values, max_size=4)
)
def test_well_formed_calls_round_trip(name: str, arguments: dict) -> None:
    body = json.dumps({"name": name, "arguments": arguments})
    for text in (
        f"<tool_call>{body}</tool_call>",
        f"<|FunctionCallBegin|>[{body}]<|FunctionCallEnd|>",
        body,
    ):
        parsed = parse_tool_calls(text)
        if "<tool_call>" in name or "</tool_call>" in name or "FunctionCall" in name:
            continue  # a name holding the delimiters is legitimately ambiguous
        assert parsed.calls == (ToolCall(name, arguments),), text
