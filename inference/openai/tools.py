"""The model's text to OpenAI `tool_calls`, with the project's tool-call parsers (`envs.parsing`).

`extract_tool_calls(text)` parses every syntax `envs.parsing` knows (Hermes/Qwen `<tool_call>`,
CodeGym `<|FunctionCallBegin|>`, bare JSON). A well-formed call becomes
a `ToolCall` (`id` "call_...", `type` function, `function.arguments` a JSON string) and the
text outside the call syntax stays the message content; text with a malformed call attempt
stays plain content with no tool calls, as vLLM's parsers treat it, so the client sees what the
model wrote. `call_syntax_start(text)` says where streamed content must stop being sent, because
what follows may be a call that is only parsed once the choice has finished.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from dataclasses import dataclass

from envs import tools as envs_tools
from envs.parsing import parse_tool_calls
from inference.openai.schema import FunctionCall, ToolCall

_OPENERS = ("<tool_call>", "<|FunctionCallBegin|>")
_BARE_STARTS = ("{", "[", "```")


@dataclass(frozen=True)
class ParsedMessage:
    """An assistant reply split into content and OpenAI tool calls."""

    content: str | None  # None when the reply is only tool calls
    tool_calls: list[ToolCall]  # OpenAI tool_calls (empty: none parsed)
    reasoning: str | None = None  # the reasoning split off the answer (None: none)


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def openai_calls(calls: Sequence[envs_tools.ToolCall]) -> list[ToolCall]:
    """Parsed calls as OpenAI `tool_calls`, keeping an id the parser gave (Mistral's)."""
    return [
        ToolCall(
            id=call.id or new_call_id(),
            type="function",  # set, so that a chunk dumped with exclude_unset carries it
            function=FunctionCall(
                name=call.name, arguments=json.dumps(call.arguments, ensure_ascii=False)
            ),
        )
        for call in calls
    ]


def extract_tool_calls(text: str) -> ParsedMessage:
    """Split `text` into content and tool calls; never raises."""
    parsed = parse_tool_calls(text)
    if parsed.error is not None or not parsed.calls:
        return ParsedMessage(text, [])
    calls = [
        ToolCall(
            id=new_call_id(),
            type="function",  # set, so that a chunk dumped with exclude_unset carries it
            function=FunctionCall(name=call.name, arguments=json.dumps(call.arguments)),
        )
        for call in parsed.calls
    ]
    return ParsedMessage(parsed.content or None, calls)


def call_syntax_start(text: str) -> int:
    """Index from which `text` may be tool-call syntax (len(text) when none can start).

    A whole reply that starts like JSON may be a bare call, so nothing of it is safe to send;
    otherwise the earliest opener, or a tail that could grow into one, is held back.
    """
    head = text.lstrip()
    if not head or head.startswith(_BARE_STARTS) or "```".startswith(head):
        return 0
    found = [at for opener in _OPENERS if (at := text.find(opener)) >= 0]
    if found:
        return min(found)
    for size in range(min(len(text), max(map(len, _OPENERS)) - 1), 0, -1):
        if any(opener.startswith(text[-size:]) for opener in _OPENERS):
            return len(text) - size
    return len(text)
