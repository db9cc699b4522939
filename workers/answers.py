"""A completion's tokens to the answer an environment gets, the way vLLM serves it.

`AnswerReader` decodes the sampled ids as vLLM's detokenizer would for the run's parsers (the
stop token that ended the turn is not text; special tokens are kept where the tool parser asks
for them, as vLLM's `adjust_request` does for hermes and mistral), splits off the reasoning with
the run's reasoning parser (`envs.reasoning`), and parses the answer's tool calls with the
run's tool parser (`envs.toolparsers`). The environment receives an `envs.parsing.Action`: the
answer text, with the parse and the reasoning beside it; with the default parsers (`auto`, no
reasoning) the action is the text decoded as before and environments parse it themselves.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from envs.parsing import PARSER_NAMES, Action, parse_with
from envs.reasoning import ReasoningTokens, split
from envs.toolparsers import KEEPS_SPECIAL_TOKENS
from workers.tokens import ChatCodec


@dataclass(frozen=True)
class Answer:
    """One completion, read."""

    action: Any  # what the environment's step receives (an Action, or plain text)
    reasoning_tokens: int  # completion tokens, from the start, that are reasoning


class AnswerReader:
    """Reads completions for one run: its codec, tool parser and reasoning parser."""

    def __init__(
        self, codec: ChatCodec, tool_parser: str = "auto", reasoning_parser: str = "none"
    ) -> None:
        if tool_parser not in PARSER_NAMES:
            raise ValueError(
                f"unknown tool parser {tool_parser!r}; known: {', '.join(PARSER_NAMES)}"
            )
        self.codec = codec
        self.tool_parser = tool_parser
        self.reasoning_parser = reasoning_parser
        self.thinking = codec.template_kwargs.get("enable_thinking", True) is not False
        vocab = codec.vocab() if reasoning_parser != "none" else {}
        self._count = ReasoningTokens.of(reasoning_parser, vocab, thinking=self.thinking)
        self._keep_special = tool_parser in KEEPS_SPECIAL_TOKENS
        # the defaults: the text decoded as ever, environments parse it themselves
        self.plain = tool_parser == "auto" and reasoning_parser == "none"

    def read(self, completion_ids: Sequence[int], *, thinking: bool | None = None) -> Answer:
        """Read one completion; `thinking` overrides the run's (a request's own
        `enable_thinking`, at the agent endpoint)."""
        thinking = self.thinking if thinking is None else thinking
        if self.plain:
            return Answer(self.codec.decode(completion_ids), 0)
        ids = list(completion_ids)
        if ids and ids[-1] in self.codec.stop_token_ids:
            ids = ids[:-1]  # vLLM does not detokenize the stop token that ended the turn
        text = self.codec.decode(ids, skip_special=not self._keep_special)
        reasoned = split(self.reasoning_parser, text, thinking=thinking)
        parsed = (
            None if self.tool_parser == "auto" else parse_with(self.tool_parser, reasoned.answer)
        )
        action = Action(reasoned.answer, parsed, reasoned.reasoning or "")
        count = (
            self._count
            if thinking == self.thinking
            else dataclasses.replace(self._count, thinking=thinking)
        )
        return Answer(action, count.count(completion_ids))
