"""The `POST /v1/responses` handler both endpoints share, over a chat completion callable.

An endpoint passes how it answers one chat completion request (a dict in, the chat completion
response as a dict out: the call is generated and recorded by its own chat path) and where it
keeps stored responses; this module parses the Responses request, builds the chat request
(`inference.openai.responses_api`), stores the conversation for `previous_response_id`, and
answers as a Response object or as the Responses event stream, in a transport-free `Reply`.
The stream is sent once the reply is generated, as the worker endpoint sends chat streams.
"""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import orjson

from inference.openai.body import parse_body
from inference.openai.reply import Reply, frames_of
from inference.openai.responses_api import (
    ResponsesRequest,
    ResponseStore,
    chat_body,
    response_body,
    stored_conversation,
    stream_events,
)

ChatCall = Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]


async def answer_responses(raw: bytes, store: ResponseStore, complete: ChatCall) -> Reply:
    """Answer one `/v1/responses` body through `complete` (raises ApiError on refusal)."""
    req = parse_body(raw, ResponsesRequest)
    history = store.get(req.previous_response_id) if req.previous_response_id else []
    chat_request = chat_body(req, history)
    chat = await complete(chat_request)
    response_id = f"resp_{uuid.uuid4().hex}"
    response = response_body(req, chat, response_id)
    if req.store:
        store.put(response_id, stored_conversation(chat_request, chat))
    if not req.stream:
        return Reply.json(response)
    return Reply.stream(
        frames_of(
            b"event: " + event["type"].encode() + b"\ndata: " + orjson.dumps(event) + b"\n\n"
            for event in stream_events(response)
        )
    )
