"""Response and chunk builders in vLLM 0.33's OpenAI shapes, from what a choice generated.

Pure functions over neutral inputs, so any endpoint builds identical responses: a
`Generated` holds a choice's tokens (all of them, or those since its last chunk) with their raw
logprobs, top alternatives and weight-version labels; an `OutputFormat` says what the request
asked to see (logprobs, top-N, token ids, version spans, and how to name a token). Logprobs are
clamped at -9999.0 as vLLM does, so JSON never carries -inf.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel

from inference.openai.schema import (
    ChatChoice,
    ChatCompletionChunk,
    ChatDelta,
    ChatLogprobs,
    ChatMessage,
    ChatStreamChoice,
    CompletionLogprobs,
    LogprobEntry,
    TopLogprob,
    Usage,
    WeightVersionSpan,
    response_id,
)
from inference.openai.tools import ParsedMessage

TokenText = Callable[[int], str]
Tops = Sequence[Sequence[tuple[int, float]]]


@dataclass(frozen=True)
class Generated:
    """Tokens of one choice: all of them, or those after index `start` (a chunk's)."""

    token_ids: Sequence[int]  # sampled ids
    logprobs: Sequence[float]  # raw logprob of each sampled id
    tops: Tops  # per token, the most likely (id, logprob) pairs (empty when not asked for)
    versions: Sequence[str]  # per token, the weight version label that sampled it
    start: int = 0  # index of token_ids[0] among all of the choice's tokens


@dataclass(frozen=True)
class OutputFormat:
    """What a request asked to see of each choice's tokens."""

    token_text: TokenText  # names a token: its text, or `token_id:<id>`
    logprobs: bool = False  # report logprobs
    top_logprobs: int = 0  # alternatives per token (chat) / per step (completions)
    token_ids: bool = False  # return_token_ids
    weight_versions: bool = False  # return_weight_versions


def _lp(value: float) -> float:
    return max(value, -9999.0)


def _top(token_text: TokenText, token_id: int, logprob: float) -> dict[str, Any]:
    text = token_text(token_id)
    return {"token": text, "logprob": _lp(logprob), "bytes": list(text.encode())}


def chat_logprobs(gen: Generated, fmt: OutputFormat) -> ChatLogprobs:
    """OpenAI chat logprobs: one entry per token with its `top_logprobs` alternatives."""
    content = [
        LogprobEntry(
            **_top(fmt.token_text, token_id, logprob),
            top_logprobs=[
                TopLogprob(**_top(fmt.token_text, t, lp)) for t, lp in step[: fmt.top_logprobs]
            ],
        )
        for token_id, logprob, step in zip(gen.token_ids, gen.logprobs, gen.tops, strict=True)
    ]
    return ChatLogprobs(content=content)


def legacy_logprobs(gen: Generated, fmt: OutputFormat, text_start: int = 0) -> CompletionLogprobs:
    """OpenAI completions logprobs; each `top_logprobs` entry holds the sampled token plus
    the most likely ones."""
    tokens = [fmt.token_text(t) for t in gen.token_ids]
    offsets, pos = [], text_start
    for text in tokens:
        offsets.append(pos)
        pos += len(text)
    top = [
        {fmt.token_text(t): _lp(lp) for t, lp in [(tok, lp), *step[: fmt.top_logprobs]]}
        for tok, lp, step in zip(gen.token_ids, gen.logprobs, gen.tops, strict=True)
    ]
    return CompletionLogprobs(
        tokens=tokens,
        token_logprobs=[_lp(v) for v in gen.logprobs],
        top_logprobs=top,
        text_offset=offsets,
    )


def version_spans(labels: Sequence[str], offset: int = 0) -> list[WeightVersionSpan]:
    """Per-token version labels -> contiguous half-open spans, counted from `offset`."""
    spans: list[WeightVersionSpan] = []
    for i, label in enumerate(labels, start=offset):
        if spans and spans[-1].version == label:
            spans[-1].end = i + 1
        else:
            spans.append(WeightVersionSpan(version=label, start=i, end=i + 1))
    return spans


def token_fields(gen: Generated, fmt: OutputFormat, *, chat: bool) -> dict[str, Any]:
    """The requested per-choice extras: `logprobs`, `token_ids`, `weight_versions`."""
    fields: dict[str, Any] = {"logprobs": None}
    if fmt.logprobs:
        fields["logprobs"] = chat_logprobs(gen, fmt) if chat else legacy_logprobs(gen, fmt)
    if fmt.token_ids:
        fields["token_ids"] = list(gen.token_ids)
    if fmt.weight_versions:
        fields["weight_versions"] = version_spans(gen.versions, gen.start)
    return fields


def usage(prompt_tokens: int, completion_tokens: int) -> Usage:
    return Usage(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
    )


def chat_finish_reason(engine_reason: str | None, tool_calls: bool) -> str:
    """vLLM's rule: a choice that stopped by itself with tool calls finished `tool_calls`;
    a `length` cut stays `length`, so a truncated call is visible as such."""
    reason = engine_reason or "stop"
    return "tool_calls" if tool_calls and reason == "stop" else reason


def chat_choice(
    index: int,
    parsed: ParsedMessage,
    gen: Generated,
    fmt: OutputFormat,
    *,
    finish_reason: str | None,
    stop_reason: int | str | None,
) -> ChatChoice:
    """A whole choice of a chat completion."""
    return ChatChoice(
        index=index,
        message=ChatMessage(
            content=parsed.content, tool_calls=parsed.tool_calls, reasoning=parsed.reasoning
        ),
        finish_reason=chat_finish_reason(finish_reason, bool(parsed.tool_calls)),
        stop_reason=stop_reason,
        **token_fields(gen, fmt, chat=True),
    )


def chat_completion_body(
    model: str,
    parsed: ParsedMessage,
    gen: Generated,
    fmt: OutputFormat,
    *,
    finish_reason: str | None,
    prompt_ids: Sequence[int] | None,
    prompt_tokens: int,
) -> dict[str, Any]:
    """One choice's chat completion as the JSON-ready dict `ChatCompletionResponse` dumps to
    (`prompt_ids` only where return_token_ids asked for them). Built without pydantic: an
    agent endpoint answers every call of every episode, and validating models it built
    itself cost ~17 us a call; tests hold the dict to the model."""
    extras = token_fields(gen, fmt, chat=True)
    for name, value in extras.items():
        if isinstance(value, BaseModel):
            extras[name] = value.model_dump(mode="json")
        elif isinstance(value, list) and value and isinstance(value[0], BaseModel):
            extras[name] = [v.model_dump(mode="json") for v in value]
    calls = [c.model_dump(mode="json") for c in parsed.tool_calls]
    choice = {
        "logprobs": None,
        "token_ids": None,
        "weight_versions": None,
        **extras,
        "index": 0,
        "message": {
            "role": "assistant",
            "content": parsed.content,
            "tool_calls": calls,
            "reasoning": parsed.reasoning,
        },
        "finish_reason": chat_finish_reason(finish_reason, bool(calls)),
        "stop_reason": None,
    }
    completion = len(gen.token_ids)
    return {
        "id": response_id("chatcmpl"),
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [choice],
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": prompt_tokens + completion,
        },
        "prompt_token_ids": list(prompt_ids) if prompt_ids is not None else None,
    }


@dataclass(frozen=True)
class StreamHead:
    """What every chunk of one streamed response repeats: its id, creation time and model."""

    model: str  # served model name
    kind: str = "chat.completion.chunk"  # the chunks' `object` ("text_completion" for text)
    id: str = field(default="")  # generated when empty
    created: int = field(default_factory=lambda: int(time.time()))  # unix time

    def __post_init__(self) -> None:
        if not self.id:
            prefix = "chatcmpl" if self.kind.startswith("chat") else "cmpl"
            object.__setattr__(self, "id", response_id(prefix))

    def fields(self) -> dict[str, Any]:
        """The head as explicitly set fields (chunks are dumped with exclude_unset)."""
        return {"id": self.id, "object": self.kind, "created": self.created, "model": self.model}


def usage_chunk(head: StreamHead, usage_: Usage) -> dict[str, Any]:
    """The last chunk of a stream with `include_usage`: no choices, the usage."""
    return head.fields() | {"choices": [], "usage": usage_.model_dump()}


def chat_chunk(
    head: StreamHead, choices: list[ChatStreamChoice], usage_: Usage | None = None
) -> ChatCompletionChunk:
    """A chunk of a streamed chat completion (no choices and `usage_`: the usage chunk)."""
    extra = {"usage": usage_} if usage_ is not None else {}
    return ChatCompletionChunk(**head.fields(), choices=choices, **extra)


def chat_stream_choice(
    index: int,
    delta: ChatDelta,
    gen: Generated | None = None,
    fmt: OutputFormat | None = None,
    *,
    finish_reason: str | None = None,
    stop_reason: int | str | None = None,
) -> ChatStreamChoice:
    """A choice's part of a chunk; `gen` (with `fmt`) adds the new tokens' extras."""
    fields = token_fields(gen, fmt, chat=True) if gen is not None and fmt is not None else {}
    closing = {"stop_reason": stop_reason} if finish_reason is not None else {}
    return ChatStreamChoice(
        index=index,
        delta=delta,
        finish_reason=finish_reason,
        **({"logprobs": None} | fields | closing),
    )
