"""The `POST /v1/responses` handler both endpoints share, over a chat completion callable.

An endpoint passes how it answers one chat completion request (a dict in, the chat completion
response as a dict out: the call is generated and recorded by its own chat path) and where it
keeps stored responses; this module parses the Responses request, builds the chat request
(`inference.openai.responses_api`), stores the conversation for `previous_response_id`, and
answers as a Response object or as the Responses event stream. The stream is sent once the
reply is generated, as the worker endpoint sends chat streams.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import orjson
from aiohttp import web
from pydantic import ValidationError

from inference.openai.errors import ApiError, from_validation
from inference.openai.responses_api import (
    ResponsesRequest,
    ResponseStore,
    chat_body,
    response_body,
    stored_conversation,
    stream_events,
)
from inference.openai.sse import open_event_stream

ChatCall = Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]


def parse_responses_request(raw: bytes) -> ResponsesRequest:
    """The body as a ResponsesRequest; a malformed body or field is a 400 naming it."""
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ApiError(f"malformed JSON body: {exc}") from None
    if not isinstance(body, dict):
        raise ApiError("request body must be a JSON object")
    try:
        return ResponsesRequest.model_validate(body)
    except ValidationError as exc:
        raise from_validation(exc) from None


async def serve_responses(
    request: web.Request, store: ResponseStore, complete: ChatCall
) -> web.StreamResponse:
    """Answer one `/v1/responses` request through `complete` (raises ApiError on refusal)."""
    req = parse_responses_request(await request.read())
    history = store.get(req.previous_response_id) if req.previous_response_id else []
    chat_request = chat_body(req, history)
    chat = await complete(chat_request)
    response_id = f"resp_{uuid.uuid4().hex}"
    response = response_body(req, chat, response_id)
    if req.store:
        store.put(response_id, stored_conversation(chat_request, chat))
    if not req.stream:
        return web.json_response(body=orjson.dumps(response))
    stream = await open_event_stream(request)
    for event in stream_events(response):
        frame = b"event: " + event["type"].encode() + b"\ndata: " + orjson.dumps(event) + b"\n\n"
        await stream.write(frame)
    await stream.write_eof()
    return stream
