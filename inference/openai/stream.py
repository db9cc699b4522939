"""Stream state of one chat choice: which content may be sent now, and the closing delta.

While a choice generates, `content_delta()` hands out new text, holding back a tail that may
still become a stop string and, when tool calls are parsed, everything from the point where
call syntax may begin (a call is only parsed once the choice has finished, with the same
parser as a non-streamed reply). `final_delta()` sends what was held: the rest of the content
and the tool calls, each with its `index`, `id`, `type` and whole `function`. Invariant:
content deltas concatenate to a prefix of the non-streamed `content`, and the tool calls are
the non-streamed `tool_calls` (ids aside).
"""

from __future__ import annotations

from inference.openai.schema import ChatDelta, DeltaToolCall
from inference.openai.text import ChoiceText
from inference.openai.tools import call_syntax_start, extract_tool_calls


class ChatChoiceStream:
    """One choice of a streamed chat completion."""

    def __init__(self, text: ChoiceText, parse_tools: bool, forced: str = "") -> None:
        self.text = text
        self.parse_tools = parse_tools
        # a forced tool choice's opener, in the prompt (inference.openai.tool_choice): the
        # reply is read as it followed by the text, and nothing is sent before the end
        self.forced = forced
        self.sent_tokens = 0  # generated tokens already reported (logprobs, token_ids)
        self.finished = False  # the delta with finish_reason was sent

    def content_delta(self) -> str:
        limit = None
        if self.forced:
            return ""
        if self.parse_tools:
            # Parsed content is stripped: whitespace before a call is held back with it.
            limit = len(self.text.text[: call_syntax_start(self.text.text)].rstrip())
        return self.text.take(limit=limit)

    def final_delta(self) -> tuple[ChatDelta, bool]:
        """The closing delta and whether it carries tool calls."""
        if self.parse_tools:
            parsed = extract_tool_calls(self.forced + self.text.text)
            if parsed.tool_calls:
                sent = self.text.text[: self.text.emitted]
                content = parsed.content or ""
                rest = content[len(sent) :] if content.startswith(sent) else ""
                calls = [
                    DeltaToolCall(index=k, **call.model_dump())
                    for k, call in enumerate(parsed.tool_calls)
                ]
                delta = (
                    ChatDelta(tool_calls=calls, content=rest)
                    if rest
                    else ChatDelta(tool_calls=calls)
                )
                return delta, True
        rest = self.forced + self.text.take(final=True)
        return (ChatDelta(content=rest) if rest else ChatDelta()), False
