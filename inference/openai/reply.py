"""An endpoint's answer before it is put on a transport: a JSON body, or a stream of SSE frames.

The OpenAI-compatible handlers build a `Reply` from the request's bytes, so the same answer
can go out over aiohttp (`send`: a TCP or Unix-socket server) or be handed to a client in the
same process without any HTTP (the worker's in-process transport, `workers.agent_transport`).
A streamed reply's `events` is an async iterator of ready SSE frames, consumed as the
transport sends them; it may still be generating while the first frames go out.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Iterable
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

import orjson
from aiohttp import web
from pydantic import BaseModel

from inference.openai.errors import ApiError
from inference.openai.sse import open_event_stream

JSON_TYPE = "application/json"


@dataclass(frozen=True)
class Reply:
    """One answer: `status` and a JSON `body`, or (`events` set) a 200 event stream."""

    status: int = 200
    body: bytes = b""  # the JSON body (unused when `events` is set)
    events: AsyncGenerator[bytes, None] | None = None  # SSE frames, `data: [DONE]` included

    @classmethod
    def json(cls, payload: BaseModel | dict[str, Any], status: int = 200) -> Reply:
        if isinstance(payload, BaseModel):
            return cls(status, payload.model_dump_json().encode())
        return cls(status, orjson.dumps(payload))

    @classmethod
    def error(cls, exc: ApiError) -> Reply:
        return cls.json(exc.body(), exc.status)

    @classmethod
    def stream(cls, frames: AsyncGenerator[bytes, None]) -> Reply:
        return cls(events=frames)


async def frames_of(frames: Iterable[bytes]) -> AsyncGenerator[bytes, None]:
    """Frames already built, as the async iterator a streamed `Reply` carries."""
    for frame in frames:
        yield frame


async def send(request: web.Request, reply: Reply) -> web.StreamResponse:
    """Put `reply` on aiohttp: the JSON response, or the events written as they come."""
    if reply.events is None:
        return web.Response(status=reply.status, body=reply.body, content_type=JSON_TYPE)
    response = await open_event_stream(request)
    async with aclosing(reply.events) as frames:  # a client gone mid-stream ends the generator
        async for frame in frames:
            await response.write(frame)
    await response.write_eof()
    return response
