"""JSON-ready response pieces in vLLM 0.33's OpenAI shapes (chat and text completions).

Pure functions over plain lists, so any endpoint can build them from what it generated:
aligned `token_ids`, raw `logprobs` of the sampled tokens, `tops` (per step, the most likely
`(id, logprob)` pairs) and per-token weight-version labels. `token_text(id)` names a token in
logprob entries (its decoded text, or `token_id:<id>` with `return_tokens_as_token_ids`).
Logprobs are clamped at -9999.0 as vLLM does, so JSON never carries -inf.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from inference.openai.tools import ParsedMessage

TokenText = Callable[[int], str]
Tops = Sequence[Sequence[tuple[int, float]]]


def _lp(value: float) -> float:
    return max(value, -9999.0)


def chat_logprobs(
    token_ids: Sequence[int],
    logprobs: Sequence[float],
    tops: Tops,
    token_text: TokenText,
    top_n: int,
) -> dict[str, Any]:
    """OpenAI chat logprobs: `{"content": [{token, logprob, bytes, top_logprobs}]}`."""

    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        text = token_text(token_id)
        return {"token": text, "logprob": _lp(logprob), "bytes": list(text.encode())}

    content = []
    for i, (token_id, logprob) in enumerate(zip(token_ids, logprobs, strict=True)):
        item = entry(token_id, logprob)
        item["top_logprobs"] = [entry(t, lp) for t, lp in tops[i][:top_n]] if top_n else []
        content.append(item)
    return {"content": content}


def legacy_logprobs(
    token_ids: Sequence[int],
    logprobs: Sequence[float],
    tops: Tops,
    token_text: TokenText,
    text_start: int,
) -> dict[str, Any]:
    """OpenAI completions logprobs `{tokens, token_logprobs, top_logprobs, text_offset}`;
    each `top_logprobs` entry holds the sampled token plus the most likely ones."""
    tokens = [token_text(t) for t in token_ids]
    offsets, pos = [], text_start
    for text in tokens:
        offsets.append(pos)
        pos += len(text)
    top = [
        {token_text(t): _lp(lp) for t, lp in [(tok, lp), *step]}
        for tok, lp, step in zip(token_ids, logprobs, tops, strict=True)
    ]
    return {
        "tokens": tokens,
        "token_logprobs": [_lp(v) for v in logprobs],
        "top_logprobs": top,
        "text_offset": offsets,
    }


def version_spans(labels: Sequence[str], offset: int = 0) -> list[dict[str, Any]]:
    """Per-token version labels -> contiguous half-open spans `{version, start, end}`,
    counted from `offset` (the index of the first label among the choice's tokens)."""
    spans: list[dict[str, Any]] = []
    for i, label in enumerate(labels, start=offset):
        if spans and spans[-1]["version"] == label:
            spans[-1]["end"] = i + 1
        else:
            spans.append({"version": label, "start": i, "end": i + 1})
    return spans


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def chat_finish_reason(engine_reason: str | None, tool_calls: bool) -> str:
    """vLLM's rule: a choice that stopped by itself with tool calls finished `tool_calls`;
    a `length` cut stays `length`, so a truncated call is visible as such."""
    reason = engine_reason or "stop"
    return "tool_calls" if tool_calls and reason == "stop" else reason


def chat_message(parsed: ParsedMessage) -> dict[str, Any]:
    return {"role": "assistant", "content": parsed.content, "tool_calls": parsed.tool_calls}


def envelope(kind: str, model: str, request_id: str | None = None) -> dict[str, Any]:
    """The common head of a response or chunk: id, object, created, model."""
    prefix = "chatcmpl" if kind.startswith("chat") else "cmpl"
    return {
        "id": request_id or f"{prefix}-{uuid.uuid4().hex}",
        "object": kind,
        "created": int(time.time()),
        "model": model,
    }
