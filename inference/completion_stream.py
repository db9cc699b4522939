"""A streamed `/v1/completions` reply, read as its server-sent events arrive.

`GenerationClient.generate(..., on_tokens=...)` asks for `stream: true` and hands this reader's
`feed` to the HTTP client as the body's sink (`inference.http`), so each event's token ids reach
the caller while the server is still generating. At the end `choice()` gives the same dict a
whole reply's first choice holds (`token_ids`, `logprobs.token_logprobs`, `weight_versions`,
`finish_reason`), so the client treats both alike.

Both servers' shapes are read: the CPU server labels each chunk's tokens with version spans
counted from the start of the output, and vLLM 0.33 sends the spans of the whole output on the
final chunk only (`CompletionResponseStreamChoice.weight_versions`); either way the spans of
all chunks, in order, cover the output once. A malformed event, an error event or a stream that
ends before a finish reason is a `ValueError` from `choice()`: the client's retry path. Errors
inside `feed` are kept for `choice()` rather than raised, because `feed` runs in the
connection's protocol callback.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import orjson

from inference.errors import error_excerpt

TokenSink = Callable[[Sequence[int]], None]  # gets each event's new token ids, in order


class StreamedCompletion:
    """One attempt's streamed choice: what arrived so far, and whether it ended well."""

    def __init__(self, on_tokens: TokenSink) -> None:
        self.on_tokens = on_tokens
        self.token_ids: list[int] = []
        self.logprobs: list[float] = []
        self.spans: list[dict[str, Any]] = []  # weight-version spans, as the events sent them
        self.finish_reason: str | None = None
        self.done = False  # `data: [DONE]` arrived
        self.error: str | None = None  # the first thing that went wrong
        self._buffer = b""

    def feed(self, piece: bytes) -> None:
        """Take the next piece of the body (the HTTP client's sink)."""
        if self.error is not None:
            return
        self._buffer += piece.replace(b"\r\n", b"\n")
        *events, self._buffer = self._buffer.split(b"\n\n")
        for event in events:
            try:
                self._event(event)
            except Exception as exc:  # kept for choice(): see the module docstring
                self.error = f"malformed stream event: {exc!r}"
                return

    def _event(self, event: bytes) -> None:
        for line in event.split(b"\n"):
            if not line.startswith(b"data:"):
                continue  # comments (keep-alives) and other fields
            data = line[5:].strip()
            if data == b"[DONE]":
                self.done = True
                continue
            chunk = orjson.loads(data)
            if "error" in chunk:
                self.error = f"error event: {error_excerpt(data)}"
                return
            for choice in chunk["choices"]:  # none in a usage chunk
                self._choice(choice)

    def _choice(self, choice: dict[str, Any]) -> None:
        ids = choice["token_ids"] or []
        logprobs = choice["logprobs"]
        lps = logprobs["token_logprobs"] if logprobs is not None else []
        if len(ids) != len(lps) or not all(isinstance(t, int) for t in ids):
            raise ValueError("an event's token_ids and logprobs do not match")
        self.token_ids += ids
        self.logprobs += lps
        self.spans += choice.get("weight_versions") or []
        if choice.get("finish_reason") is not None:
            self.finish_reason = choice["finish_reason"]
        if ids:
            self.on_tokens(ids)

    def choice(self) -> dict[str, Any]:
        """The whole choice, in a whole reply's shape; ValueError if the stream broke off."""
        if self.error is not None:
            raise ValueError(self.error)
        if self.finish_reason is None or not self.done:
            raise ValueError("the stream ended before the completion finished")
        return {
            "token_ids": self.token_ids,
            "logprobs": {"token_logprobs": self.logprobs},
            "weight_versions": self.spans,
            "finish_reason": self.finish_reason,
        }
