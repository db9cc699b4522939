"""The OpenAI Responses API (`POST /v1/responses`) served as a translation over chat completions.

A Responses request becomes the chat completion request both endpoints of the project already
serve exactly: `instructions` becomes the first system message, the input items (messages,
`function_call`, `function_call_output`, `reasoning`) become chat messages, function tools
become chat tools, and `previous_response_id` puts the stored conversation of that response
before the new input. The chat reply goes back as Response output items (`reasoning`,
`message`, `function_call`) and, streamed, as the Responses event sequence. Because every call
goes through the chat path, what an endpoint records of it (prompt and sampled token ids) is
exactly what it records of the equivalent chat completion.

Refused with a 400 rather than ignored: non-function tools (web search, file search, ...),
forced tool choices the chat path refuses, and structured outputs (`text.format` of type
`json_schema` or `json_object`), which need guided decoding this project's servers lack.
"""

from __future__ import annotations

import time
import uuid
from collections import OrderedDict
from collections.abc import Iterator
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from inference.openai.errors import ApiError
from inference.openai.models import refuse_non_neutral

_REFUSED = {
    "background": (None, False),
    "prompt": (None,),
    "max_tool_calls": (None,),
    "presence_penalty": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0),
    "logit_bias": (None, {}),
    "top_logprobs": (None, 0),
    "truncation": (None, "disabled"),
}


class ResponsesRequest(BaseModel):
    """The accepted subset of vLLM 0.33's ResponsesRequest; unknown fields are ignored."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    model: str | None = Field(None, description="served model name (None: the served one)")
    input: str | list[dict[str, Any]] = Field(description="a user text, or input items")
    instructions: str | None = Field(None, description="system message (not carried over)")
    previous_response_id: str | None = Field(None, description="continue this stored response")
    max_output_tokens: int | None = Field(None, ge=1, description="most tokens to generate")
    temperature: float | None = Field(None, ge=0.0, le=100.0, description="0 means greedy")
    top_p: float | None = Field(None, gt=0.0, le=1.0, description="nucleus mass")
    top_k: int | None = Field(None, ge=-1, description="keep the k most likely tokens")
    min_p: float | None = Field(None, ge=0.0, le=1.0, description="drop below min_p x the top")
    tools: list[dict[str, Any]] = Field(default_factory=list, description="function tools")
    tool_choice: str | dict[str, Any] = Field("auto", description="`auto` or `none`")
    parallel_tool_calls: bool | None = Field(True, description="echoed in the response")
    stream: bool | None = Field(False, description="answer as Responses events")
    store: bool | None = Field(True, description="keep the response for previous_response_id")
    text: dict[str, Any] | None = Field(None, description="output text format (text only)")
    reasoning: dict[str, Any] | None = Field(None, description="echoed; effort is not used")
    metadata: dict[str, Any] | None = Field(None, description="echoed in the response")
    skip_special_tokens: bool | None = Field(None, description="drop special tokens")

    @model_validator(mode="before")
    @classmethod
    def _refuse_unsupported(cls, data: Any) -> Any:
        if isinstance(data, dict):
            refuse_non_neutral(data, _REFUSED)
            fmt = ((data.get("text") or {}).get("format") or {}).get("type", "text")
            if fmt != "text":
                raise ApiError(
                    f"text.format {fmt!r} (structured outputs) is not supported by this "
                    "server: it needs guided decoding",
                    "text",
                )
            for tool in data.get("tools") or []:
                if not isinstance(tool, dict) or tool.get("type") != "function":
                    kind = tool.get("type") if isinstance(tool, dict) else tool
                    raise ApiError(f"only function tools are supported, not {kind!r}", "tools")
        return data


class ResponseStore:
    """The conversations of recent responses (chat messages, the reply included), by id;
    the oldest are dropped past `capacity`."""

    def __init__(self, capacity: int = 256) -> None:
        self.capacity = capacity
        self._items: OrderedDict[str, list[dict[str, Any]]] = OrderedDict()

    def put(self, response_id: str, messages: list[dict[str, Any]]) -> None:
        self._items[response_id] = messages
        self._items.move_to_end(response_id)
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)

    def get(self, response_id: str) -> list[dict[str, Any]]:
        messages = self._items.get(response_id)
        if messages is None:
            raise ApiError(
                f"previous response {response_id!r} is unknown (never stored, or expired)",
                "previous_response_id",
                status=404,
            )
        return messages


def _text_of(content: Any) -> str:
    """A message's content (a string, or input/output text parts) as one string."""
    if isinstance(content, str):
        return content
    parts = []
    for part in content or []:
        if part.get("type") not in ("input_text", "output_text", "text"):
            raise ApiError(f"content part {part.get('type')!r} is not supported", "input")
        parts.append(part.get("text", ""))
    return "".join(parts)


def input_messages(items: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Input items -> chat messages; an assistant message, the reasoning before it and the
    function calls after it become one assistant message, as the chat template renders them."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages: list[dict[str, Any]] = []
    turn: dict[str, Any] | None = None  # the assistant message being assembled

    def flush() -> None:
        nonlocal turn
        if turn is not None:
            messages.append(turn)
            turn = None

    for item in items:
        kind = item.get("type", "message")
        role = item.get("role")
        if kind == "reasoning" or (kind == "message" and role == "assistant"):
            if turn is not None and (turn.get("content") is not None or turn.get("tool_calls")):
                flush()
            turn = turn or {"role": "assistant", "content": None}
            if kind == "reasoning":
                parts = item.get("content") or item.get("summary") or []
                turn["reasoning"] = "".join(p.get("text", "") for p in parts)
            else:
                turn["content"] = _text_of(item.get("content"))
        elif kind == "function_call":
            turn = turn or {"role": "assistant", "content": None}
            call = {"name": item["name"], "arguments": item.get("arguments", "{}")}
            call_id = item.get("call_id") or item.get("id")
            turn.setdefault("tool_calls", []).append(
                {"id": call_id, "type": "function", "function": call}
            )
        elif kind == "function_call_output":
            flush()
            output = item.get("output", "")
            content = output if isinstance(output, str) else _text_of(output)
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": content})
        elif kind == "message" and role in ("user", "system", "developer"):
            flush()
            messages.append({"role": role, "content": _text_of(item.get("content"))})
        else:
            raise ApiError(f"input item of type {kind!r} is not supported", "input")
    flush()
    return messages


def _chat_tools(tools: list[dict[str, Any]]) -> list[dict[str, Any]] | None:
    """Responses function tools (flat) -> chat tools (nested under `function`)."""
    out = []
    for tool in tools:
        function = {k: tool[k] for k in ("name", "description", "parameters") if tool.get(k)}
        if tool.get("strict"):
            function["strict"] = True
        out.append({"type": "function", "function": function})
    return out or None


def _chat_tool_choice(choice: str | dict[str, Any]) -> Any:
    if isinstance(choice, dict) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    return choice


def chat_body(req: ResponsesRequest, history: list[dict[str, Any]]) -> dict[str, Any]:
    """The chat completion request (a dict) that answers `req` after `history`."""
    system = [{"role": "system", "content": req.instructions}] if req.instructions else []
    body: dict[str, Any] = {
        "model": req.model,
        "messages": [*system, *history, *input_messages(req.input)],
        "tools": _chat_tools(req.tools),
        # the default `auto` without tools is no choice; a forced one without tools is refused
        "tool_choice": _chat_tool_choice(req.tool_choice)
        if req.tools or req.tool_choice not in ("auto", "none")
        else None,
        "max_completion_tokens": req.max_output_tokens,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "top_k": req.top_k,
        "min_p": req.min_p,
    }
    if req.skip_special_tokens is not None:
        body["skip_special_tokens"] = req.skip_special_tokens
    return {k: v for k, v in body.items() if v is not None}


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def output_items(message: dict[str, Any]) -> list[dict[str, Any]]:
    """A chat reply message -> Response output items: reasoning, message, function calls."""
    items: list[dict[str, Any]] = []
    if message.get("reasoning"):
        text = message["reasoning"]
        items.append(
            {
                "type": "reasoning",
                "id": _id("rs"),
                "summary": [],
                "content": [{"type": "reasoning_text", "text": text}],
                "status": "completed",
            }
        )
    if message.get("content"):
        part = {"type": "output_text", "text": message["content"], "annotations": []}
        items.append(
            {
                "type": "message",
                "id": _id("msg"),
                "role": "assistant",
                "status": "completed",
                "content": [part | {"logprobs": []}],
            }
        )
    for call in message.get("tool_calls") or []:
        items.append(
            {
                "type": "function_call",
                "id": _id("fc"),
                "call_id": call["id"],
                "name": call["function"]["name"],
                "arguments": call["function"]["arguments"],
                "status": "completed",
            }
        )
    return items


def response_body(req: ResponsesRequest, chat: dict[str, Any], response_id: str) -> dict[str, Any]:
    """The Response object for a chat completion response `chat` (a dict) to `req`, in the
    fields of vLLM 0.33's ResponsesResponse (tests/inference/vllm_contract holds it there)."""
    choice = chat["choices"][0]
    counts = chat["usage"]
    truncated = choice.get("finish_reason") == "length"
    return {
        "id": response_id,
        "object": "response",
        "created_at": int(time.time()),
        "model": chat["model"],
        "status": "incomplete" if truncated else "completed",
        "incomplete_details": {"reason": "max_output_tokens"} if truncated else None,
        "instructions": req.instructions,
        "output": output_items(choice["message"]),
        "parallel_tool_calls": bool(req.parallel_tool_calls),
        "tool_choice": req.tool_choice,
        "tools": req.tools,
        "temperature": 1.0 if req.temperature is None else req.temperature,  # as OpenAI echoes
        "top_p": 1.0 if req.top_p is None else req.top_p,
        "max_output_tokens": req.max_output_tokens,
        "background": False,
        "service_tier": "auto",
        "previous_response_id": req.previous_response_id,
        "reasoning": req.reasoning,
        "text": req.text or {"format": {"type": "text"}},
        "truncation": "disabled",
        "metadata": req.metadata,
        "usage": {
            "input_tokens": counts["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
            "output_tokens": counts["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": counts["total_tokens"],
        },
    }


def stored_conversation(chat_request: dict[str, Any], chat: dict[str, Any]) -> list[dict[str, Any]]:
    """What a later `previous_response_id` continues: the messages without the system
    instructions (not carried over), then the reply."""
    messages = [m for m in chat_request["messages"] if m["role"] != "system"]
    reply = chat["choices"][0]["message"]
    kept = {k: reply.get(k) for k in ("content", "tool_calls", "reasoning") if reply.get(k)}
    return [*messages, {"role": "assistant", "content": None} | kept]


class EventNumbers:
    """Numbers a response's events in order (`sequence_number`)."""

    def __init__(self) -> None:
        self.next = 0

    def event(self, kind: str, **fields: Any) -> dict[str, Any]:
        self.next += 1
        return {"type": kind, "sequence_number": self.next - 1, **fields}


def opening(response: dict[str, Any]) -> dict[str, Any]:
    """The Response as `response.created` and `response.in_progress` show it."""
    return response | {"status": "in_progress", "output": [], "usage": None}


def stream_events(response: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """A whole Response as the Responses event sequence (created ... completed)."""
    numbers = EventNumbers()
    yield numbers.event("response.created", response=opening(response))
    yield numbers.event("response.in_progress", response=opening(response))
    for index, item in enumerate(response["output"]):
        yield from item_events(numbers, index, item)
    yield closing_event(numbers, response)


def message_opened(numbers: EventNumbers, index: int, item_id: str) -> list[dict[str, Any]]:
    """The events that open a message item and its text part, before any text."""
    empty = {"type": "message", "id": item_id, "role": "assistant", "status": "in_progress"}
    part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
    return [
        numbers.event(
            "response.output_item.added", output_index=index, item=empty | {"content": []}
        ),
        numbers.event(
            "response.content_part.added",
            output_index=index,
            item_id=item_id,
            content_index=0,
            part=part,
        ),
    ]


def text_delta(numbers: EventNumbers, index: int, item_id: str, delta: str) -> dict[str, Any]:
    at = {"output_index": index, "item_id": item_id, "content_index": 0}
    return numbers.event("response.output_text.delta", **at, delta=delta, logprobs=[])


def item_events(
    numbers: EventNumbers, index: int, item: dict[str, Any], sent: str | None = None
) -> Iterator[dict[str, Any]]:
    """One output item's events; `sent`: the text of a message item already opened and
    streamed (`message_opened`, `text_delta`), which gets only the rest and its closing."""
    at = {"output_index": index, "item_id": item["id"]}
    if sent is None:
        empty = item | {"status": "in_progress"}
        if item["type"] == "message":
            empty = empty | {"content": []}
        elif item["type"] == "function_call":
            empty = empty | {"arguments": ""}
        yield numbers.event("response.output_item.added", output_index=index, item=empty)
    if item["type"] == "message":
        for k, part in enumerate(item["content"]):
            where = at | {"content_index": k}
            text = part["text"]
            if sent is None:
                blank = part | {"text": ""}
                yield numbers.event("response.content_part.added", **where, part=blank)
            rest = text
            if sent is not None and k == 0:  # the streamed text is a prefix of the whole
                rest = text[len(sent) :] if text.startswith(sent) else ""
            if rest:
                yield numbers.event("response.output_text.delta", **where, delta=rest, logprobs=[])
            yield numbers.event("response.output_text.done", **where, text=text, logprobs=[])
            yield numbers.event("response.content_part.done", **where, part=part)
    elif item["type"] == "function_call":
        args = item["arguments"]
        yield numbers.event("response.function_call_arguments.delta", **at, delta=args)
        yield numbers.event("response.function_call_arguments.done", **at, arguments=args)
    yield numbers.event("response.output_item.done", output_index=index, item=item)


def closing_event(numbers: EventNumbers, response: dict[str, Any]) -> dict[str, Any]:
    final = "response.completed" if response["status"] == "completed" else "response.incomplete"
    return numbers.event(final, response=response)
