"""Reasoning parsers: a reasoning model's output split into its reasoning and its answer.

Named as vLLM 0.33 names them (`--reasoning-parser`), and splitting as vLLM's parser of that
name does (tests/inference/vllm_contract runs vLLM's on the same texts):

- ``qwen3`` (Qwen3, QwQ): with thinking on (`enable_thinking`, the default) the output starts
  in the reasoning; ``<think>`` there is dropped, ``</think>`` ends it (and is dropped again if
  repeated), and a ``<tool_call>`` ends it too and starts the answer. With thinking off the whole
  output is the answer.
- ``deepseek_r1`` (DeepSeek-R1 and its distills, whose prompt ends inside ``<think>``): what
  precedes a ``<think>`` is dropped; the reasoning runs to the first ``</think>``, the answer is
  the rest; without ``</think>`` everything is reasoning.

`reasoning_tokens(ids)` says how many of a completion's tokens, from its start, are the
reasoning with its markers: what `Turn.reasoning_tokens` records for inspection.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

THINK, END_THINK, TOOL_CALL = "<think>", "</think>", "<tool_call>"
NAMES = ("none", "qwen3", "deepseek_r1")
_QWEN3_MARKERS = re.compile("(<think>|</think>|<tool_call>)")


@dataclass(frozen=True)
class Reasoned:
    """One output, split."""

    reasoning: str | None  # None: no reasoning (vLLM's null)
    answer: str  # what the environment gets ("" when the output was all reasoning)


def split(parser: str, text: str, *, thinking: bool = True) -> Reasoned:
    """Split `text` as vLLM's reasoning parser `parser` does."""
    if parser == "none":
        return Reasoned(None, text)
    if parser == "qwen3":
        return _qwen3(text) if thinking else Reasoned(None, text)
    if parser == "deepseek_r1":
        return _deepseek_r1(text)
    raise ValueError(f"unknown reasoning parser {parser!r}; known: {', '.join(NAMES)}")


def _qwen3(text: str) -> Reasoned:
    reasoning, answer, in_reasoning = [], [], True
    for part in _QWEN3_MARKERS.split(text):
        if in_reasoning:
            if part == TOOL_CALL:
                in_reasoning = False
                answer.append(part)
            elif part == END_THINK:
                in_reasoning = False
            elif part != THINK:
                reasoning.append(part)
        elif part != END_THINK:
            answer.append(part)
    return Reasoned("".join(reasoning) or None, "".join(answer))


def _deepseek_r1(text: str) -> Reasoned:
    before, found, after = text.partition(THINK)
    body = after if found else before
    if END_THINK not in body:
        return Reasoned(body, "")
    reasoning, _, answer = body.partition(END_THINK)
    return Reasoned(reasoning, answer)


@dataclass(frozen=True)
class ReasoningTokens:
    """Counts a completion's reasoning tokens by the markers' token ids."""

    parser: str
    thinking: bool
    ids: Mapping[str, int]  # marker -> token id, for the markers the vocabulary has

    @classmethod
    def of(cls, parser: str, vocab: Mapping[str, int], *, thinking: bool = True) -> ReasoningTokens:
        if parser not in NAMES:
            raise ValueError(f"unknown reasoning parser {parser!r}; known: {', '.join(NAMES)}")
        markers = {m: vocab[m] for m in (THINK, END_THINK, TOOL_CALL) if m in vocab}
        if parser != "none" and END_THINK not in markers:
            raise ValueError(f"reasoning parser {parser!r} needs {END_THINK} in the vocabulary")
        return cls(parser, thinking, markers)

    def count(self, completion: Sequence[int]) -> int:
        """Tokens from the start that are reasoning, the marker that ends it included."""
        if self.parser == "none" or (self.parser == "qwen3" and not self.thinking):
            return 0
        end, call = self.ids.get(END_THINK), self.ids.get(TOOL_CALL)
        for i, token in enumerate(completion):
            if token == end:
                return i + 1
            if self.parser == "qwen3" and token == call:
                return i
        return len(completion)
