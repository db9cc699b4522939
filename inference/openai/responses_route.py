"""The `POST /v1/responses` handler both endpoints share, over a chat completion callable.

An endpoint passes how it answers one chat completion request (a dict in, the chat completion
response as a dict out: the call is generated and recorded by its own chat path) and where it
keeps stored responses; this module parses the Responses request, builds the chat request
(`inference.openai.responses_api`), stores the conversation for `previous_response_id`, and
answers as a Response object or as the Responses event stream, in a transport-free `Reply`.
An endpoint that can stream a call as it is generated passes `live` as well: it admits the call
(a refusal is still an HTTP error) and hands back an async iterator of content deltas, then the
chat completion dict; the events then go out as the text comes (the message item is opened at
the first delta), and the rest once the reply is whole. Without `live` the stream is sent once
the reply is generated.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import AsyncGenerator, Awaitable, Callable, Iterable
from typing import Any

import orjson

from inference.openai.body import parse_body
from inference.openai.errors import ApiError
from inference.openai.reply import Reply, frames_of
from inference.openai.responses_api import (
    EventNumbers,
    ResponsesRequest,
    ResponseStore,
    chat_body,
    closing_event,
    item_events,
    message_opened,
    opening,
    response_body,
    stored_conversation,
    stream_events,
    text_delta,
)

ChatCall = Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]
# a chat request (a dict) -> the model name it answers as, and its content deltas (str) then
# the chat completion dict; admission happens in the call, so it raises ApiError at once
LiveCall = Callable[[dict[str, Any]], tuple[str, AsyncGenerator[str | dict[str, Any], None]]]


async def answer_responses(
    raw: bytes, store: ResponseStore, complete: ChatCall, live: LiveCall | None = None
) -> Reply:
    """Answer one `/v1/responses` body through `complete`, or `live` for a stream where
    given (both raise ApiError on refusal)."""
    req = parse_body(raw, ResponsesRequest)
    history = store.get(req.previous_response_id) if req.previous_response_id else []
    chat_request = chat_body(req, history)
    response_id = f"resp_{uuid.uuid4().hex}"
    if req.stream and live is not None:
        model, pieces = live(chat_request)
        return Reply.stream(
            _live(req, store, chat_request, response_id, model=model, pieces=pieces)
        )
    chat = await complete(chat_request)
    response = _finish(req, store, chat_request, chat, response_id)
    if not req.stream:
        return Reply.json(response)
    return Reply.stream(frames_of(_frames(stream_events(response))))


def _finish(
    req: ResponsesRequest,
    store: ResponseStore,
    chat_request: dict[str, Any],
    chat: dict[str, Any],
    response_id: str,
) -> dict[str, Any]:
    """The Response for the generated chat reply, stored for `previous_response_id`."""
    response = response_body(req, chat, response_id)
    if req.store:
        store.put(response_id, stored_conversation(chat_request, chat))
    return response


def _frames(events: Iterable[dict[str, Any]]) -> Iterable[bytes]:
    for event in events:
        yield b"event: " + event["type"].encode() + b"\ndata: " + orjson.dumps(event) + b"\n\n"


async def _live(
    req: ResponsesRequest,
    store: ResponseStore,
    chat_request: dict[str, Any],
    response_id: str,
    *,
    model: str,
    pieces: AsyncGenerator[str | dict[str, Any], None],
) -> AsyncGenerator[bytes, None]:
    """The events of a reply as it is generated: the text deltas of its message item as they
    come, everything else once the reply is whole."""
    numbers = EventNumbers()
    head = opening(response_body(req, _no_reply(model), response_id))
    opened = [numbers.event("response.created", response=head)]
    opened.append(numbers.event("response.in_progress", response=head))
    for frame in _frames(opened):
        yield frame
    message_id, sent = f"msg_{uuid.uuid4().hex}", []
    try:
        async with contextlib.aclosing(pieces) as deltas:
            async for piece in deltas:
                if isinstance(piece, dict):
                    chat = piece
                    continue
                events = [] if sent else message_opened(numbers, 0, message_id)
                sent.append(piece)
                for frame in _frames([*events, text_delta(numbers, 0, message_id, piece)]):
                    yield frame
    except ApiError as exc:  # after the stream began: an error event, as OpenAI sends one
        error = exc.body()["error"]
        event = numbers.event("error", code=str(error.get("code")), message=error["message"])
        for frame in _frames([event | {"param": error.get("param")}]):
            yield frame
        return
    response = _finish(req, store, chat_request, chat, response_id)
    closing = []
    for index, item in enumerate(response["output"]):
        if sent and index == 0 and item["type"] == "message":
            item["id"] = message_id  # the id its opening events announced
            closing += item_events(numbers, index, item, "".join(sent))
        else:
            closing += item_events(numbers, index, item)
    closing.append(closing_event(numbers, response))
    for frame in _frames(closing):
        yield frame


def _no_reply(model: str) -> dict[str, Any]:
    """A chat completion with nothing in it yet: what the opening Response is built from."""
    usage = {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}
    return {"model": model, "choices": [{"message": {}, "finish_reason": None}], "usage": usage}
