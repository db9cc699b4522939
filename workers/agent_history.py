"""What an episode's previous call sent, so that the next call validates and converts only the
messages it adds.

An agent sends its whole conversation again on every call. Validating it (pydantic) and turning
it into the dicts a chat template reads cost several microseconds a message, on every call, so
an episode's endpoint CPU grew with the square of its length. `MessageCache.request(body)`
swaps the leading messages that equal the previous call's, as decoded from JSON, for the
`Message` objects they validated to (pydantic takes a model instance as it is), and
`template(messages)` reuses the previous call's template dicts for those same objects.
When every field but `messages` is the previous call's, as an agent's loop sends them, the
previous request is copied with the new message list and only the new messages are validated:
the request-level checks read only those other fields, which already passed.
Invariant: only a message equal to one already validated is reused, so every new or edited
message is validated as before, and a bad one gets the same 400 naming its index (a new
message that fails takes the whole path, which names it).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import TypeAdapter, ValidationError

from inference.openai.body import json_object, validate
from inference.openai.errors import ApiError
from inference.openai.models import ChatCompletionRequest, Message
from inference.openai.render import template_messages

_MESSAGES: TypeAdapter[list[Message]] = TypeAdapter(list[Message])


def chat_request(body: Any) -> ChatCompletionRequest:
    """A decoded chat completion body as the request; a bad one is a 400 naming the field."""
    if json_object(body).get("n", 1) != 1:
        raise ApiError("n must be 1: one call is one turn of the episode", "n")
    if body.get("ignore_eos"):
        raise ApiError(
            "ignore_eos is not supported here: a call ends at the model's end of turn",
            "ignore_eos",
        )
    return validate(ChatCompletionRequest, body)


@dataclass
class MessageCache:
    """One episode's previous call: its messages as sent, as validated, as templated."""

    raw: Sequence[Any] = ()  # the messages as decoded from the call's JSON
    validated: Sequence[Message] = ()  # what they validated to
    templated: Sequence[tuple[Message, dict[str, Any]]] = ()  # message -> its template dict
    rest: dict[str, Any] | None = None  # the previous call's other fields, as decoded
    last: ChatCompletionRequest | None = None  # and the request they validated to

    def request(self, body: Any) -> ChatCompletionRequest:
        """`chat_request(body)`, the messages the previous call sent already validated."""
        messages = body.get("messages") if isinstance(body, dict) else None
        if not isinstance(messages, list):
            return chat_request(body)
        same = _common_prefix(messages, self.raw) if self.raw else 0
        rest = {k: v for k, v in body.items() if k != "messages"}
        req = self._same_fields(rest, messages, same)
        if req is None:
            if same:
                body = {**body, "messages": [*self.validated[:same], *messages[same:]]}
            req = chat_request(body)
        self.raw, self.validated, self.rest, self.last = messages, req.messages, rest, req
        return req

    def _same_fields(
        self, rest: dict[str, Any], messages: list[Any], same: int
    ) -> ChatCompletionRequest | None:
        """The previous request with these messages, where only the messages changed."""
        if self.last is None or rest != self.rest or not messages:
            return None
        try:
            new = _MESSAGES.validate_python(messages[same:]) if same < len(messages) else []
        except ValidationError:
            return None  # the whole path names the bad message
        return self.last.model_copy(update={"messages": [*self.validated[:same], *new]})

    def template(self, messages: Sequence[Message]) -> list[dict[str, Any]]:
        """`template_messages(messages)`, reusing the dicts of the messages seen last call."""
        before = self.templated
        same = _common_prefix(messages, [message for message, _ in before], by_identity=True)
        out = [d for _, d in before[:same]] + template_messages(messages[same:])
        self.templated = tuple(zip(messages, out, strict=True))
        return out


def _common_prefix(a: Sequence[Any], b: Sequence[Any], *, by_identity: bool = False) -> int:
    """How many leading items `a` and `b` share (equal, or the same objects `by_identity`)."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x is not y and (by_identity or x != y):
            break
        n += 1
    return n
