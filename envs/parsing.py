"""Tool-call parsing: the model's text to ``ToolCall``s, never raising.

A run names its parser (`--tool-parser`): ``auto`` (the default, below) or one of vLLM's
family parsers (`envs.toolparsers`: hermes, qwen3_json, llama3_json, mistral, pythonic).
The worker parses each answer with the run's parser and hands the environment an ``Action``:
the answer text, carrying the parse, which ``parse_tool_calls`` returns as it is. So every
environment that parses its action reads the calls the model's family writes.

``auto`` recognises three syntaxes, tried in this order:

- OpenAI/Hermes: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (one or
  more blocks; ``arguments`` may also be a JSON-encoded string);
- CodeGym: ``<|FunctionCallBegin|>[{"name": ..., "parameters": {...}}]<|FunctionCallEnd|>``;
- bare JSON: the whole text (optionally in a code fence) is one call object or a list.

Text with no call syntax at all is plain content (no calls, no error). Text that
attempts a call but is malformed yields ``error`` set: the caller turns that into
an error observation with ``ErrorCategory.FORMAT``. ``parse_tool_calls`` catches
its own failure modes (bad JSON, deep nesting, wrong shapes) and returns; it has a
hypothesis property test that it never raises.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from envs import toolparsers
from envs.tools import ToolCall

_HERMES = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_CODEGYM = re.compile(r"<\|FunctionCallBegin\|>(.*?)<\|FunctionCallEnd\|>", re.DOTALL)
_FENCE = re.compile(r"^```(?:json)?\s*(.*?)\s*```$", re.DOTALL)
_MAX_TEXT = 200_000  # longer actions are not parsed (bounded work per step)


@dataclass(frozen=True)
class ParsedAction:
    """The outcome of parsing one action."""

    calls: tuple[ToolCall, ...]  # the well-formed calls, in order
    content: str  # the text outside any call syntax, stripped
    error: str | None = None  # set when a call was attempted but is malformed
    syntax: str = "none"  # "hermes", "codegym", "json", "none", or a family parser's name


class Action(str):
    """The model's answer as an environment receives it: the text (reasoning removed), with
    the tool calls the run's parser found in it and the reasoning beside it."""

    parsed: ParsedAction | None  # the run's parse of this text (None: parse on demand)
    reasoning: str  # the reasoning the answer followed ("" when none)

    def __new__(cls, text: str, parsed: ParsedAction | None = None, reasoning: str = "") -> Action:
        action = super().__new__(cls, text)
        action.parsed = parsed
        action.reasoning = reasoning
        return action


PARSER_NAMES = ("auto", *toolparsers.PARSERS)


def parse_with(parser: str, text: str) -> ParsedAction:
    """Parse `text` with the parser named `parser` (`PARSER_NAMES`); never raises."""
    if parser == "auto":
        return parse_tool_calls(str(text))
    if len(text) > _MAX_TEXT:
        return ParsedAction((), "", f"action longer than {_MAX_TEXT} characters", parser)
    try:
        calls, content, error = toolparsers.PARSERS[parser](text)
    except RecursionError:
        return ParsedAction((), "", "tool call nested too deeply", parser)
    return ParsedAction(tuple(calls), content or "", error, parser)


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise ValueError(f"invalid JSON in tool call: {str(exc)[:120]}") from None


def _to_call(obj: Any) -> ToolCall:
    if not isinstance(obj, dict):
        raise ValueError(f"a tool call must be a JSON object, got {type(obj).__name__}")
    if isinstance(obj.get("function"), dict):  # OpenAI {"type": "function", "function": {...}}
        obj = obj["function"]
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        raise ValueError("a tool call needs a non-empty string 'name'")
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        args = _loads(args) if args.strip() else {}
    if args is None:
        args = {}
    if not isinstance(args, dict):
        raise ValueError(f"arguments of {name!r} must be a JSON object")
    return ToolCall(name=name, arguments=args)


def _calls_from(payload: Any) -> list[ToolCall]:
    items = payload if isinstance(payload, list) else [payload]
    if not items:
        raise ValueError("empty tool call list")
    return [_to_call(item) for item in items]


def _parse_blocks(
    text: str, pattern: re.Pattern[str], opener: str, closer: str, syntax: str
) -> ParsedAction | None:
    blocks = pattern.findall(text)
    if not blocks:
        if opener in text or closer in text:
            return ParsedAction((), text.strip(), f"unbalanced {opener} ... {closer}", syntax)
        return None
    content = pattern.sub("", text).strip()
    if opener in content or closer in content:
        return ParsedAction((), content, f"unbalanced {opener} ... {closer}", syntax)
    calls: list[ToolCall] = []
    try:
        for block in blocks:
            calls.extend(_calls_from(_loads(block.strip())))
    except ValueError as exc:
        return ParsedAction(tuple(calls), content, str(exc), syntax)
    return ParsedAction(tuple(calls), content, None, syntax)


def _parse_bare(text: str) -> ParsedAction | None:
    stripped = text.strip()
    fenced = _FENCE.match(stripped)
    body = fenced.group(1) if fenced else stripped
    if not body.startswith(("{", "[")):
        return None
    try:
        payload = json.loads(body)
    except (ValueError, RecursionError):
        # Only a fenced block or an object that names a tool is an attempted call.
        if fenced or '"name"' in body:
            return ParsedAction((), stripped, "invalid JSON in tool call", "json")
        return None
    looks_like_call = (isinstance(payload, dict) and "name" in payload) or (
        isinstance(payload, list)
        and payload
        and all(isinstance(p, dict) and "name" in p for p in payload)
    )
    if not looks_like_call:
        return None
    try:
        return ParsedAction(tuple(_calls_from(payload)), "", None, "json")
    except (ValueError, RecursionError) as exc:
        return ParsedAction((), stripped, str(exc), "json")


def parse_tool_calls(text: Any) -> ParsedAction:
    """Parse tool calls out of a model action; never raises. An `Action` carries the run's
    own parse, which is returned as it is."""
    if isinstance(text, Action) and text.parsed is not None:
        return text.parsed
    if not isinstance(text, str):
        return ParsedAction((), "", f"action must be text, got {type(text).__name__}")
    if len(text) > _MAX_TEXT:
        return ParsedAction((), "", f"action longer than {_MAX_TEXT} characters")
    try:
        for pattern, opener, closer, syntax in (
            (_HERMES, "<tool_call>", "</tool_call>", "hermes"),
            (_CODEGYM, "<|FunctionCallBegin|>", "<|FunctionCallEnd|>", "codegym"),
        ):
            parsed = _parse_blocks(text, pattern, opener, closer, syntax)
            if parsed is not None:
                return parsed
        return _parse_bare(text) or ParsedAction((), text.strip())
    except RecursionError:
        return ParsedAction((), "", "tool call nested too deeply")
