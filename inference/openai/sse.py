"""Server-sent events as OpenAI streams them: `data: <json>\\n\\n` per chunk, then `data: [DONE]`.

`sse_event` encodes one chunk; `open_event_stream` starts an aiohttp streaming response with
the headers OpenAI clients expect. The byte shape is the same whatever builds the chunks.
"""

from __future__ import annotations

from typing import Any

import orjson
from aiohttp import web
from pydantic import BaseModel

SSE_DONE = b"data: [DONE]\n\n"
SSE_HEADERS = {
    "Content-Type": "text/event-stream; charset=utf-8",
    "Cache-Control": "no-cache",
    "X-Accel-Buffering": "no",  # a proxy must not hold chunks back
}


def sse_event(payload: BaseModel | dict[str, Any]) -> bytes:
    """One event carrying `payload` as compact JSON; a model is dumped with `exclude_unset`,
    as vLLM sends chunks, so a chunk carries only the fields its builder set."""
    if isinstance(payload, BaseModel):
        return b"data: " + payload.model_dump_json(exclude_unset=True).encode() + b"\n\n"
    return b"data: " + orjson.dumps(payload) + b"\n\n"


async def open_event_stream(request: web.Request) -> web.StreamResponse:
    """A prepared 200 `text/event-stream` response to write events to."""
    response = web.StreamResponse(status=200, headers=SSE_HEADERS)
    await response.prepare(request)
    return response
