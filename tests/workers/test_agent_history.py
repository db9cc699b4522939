"""The per-episode message cache of the agent endpoint (`workers.agent_history`): a call that
sends its history again validates and converts only what it adds, and an edit anywhere is
validated afresh."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from inference.openai.errors import ApiError
from inference.openai.render import template_messages
from workers.agent_history import MessageCache

CALL = {"id": "c1", "type": "function", "function": {"name": "run", "arguments": '{"x": 1}'}}
HISTORY: list[dict[str, Any]] = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": "go"},
    {"role": "assistant", "content": None, "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "c1", "content": "ok"},
]


def _body(messages: list[dict[str, Any]]) -> Any:
    """A body as the endpoint decodes it: fresh objects every call, as an agent resends."""
    return orjson.loads(orjson.dumps({"model": "m", "messages": messages}))


def test_a_resent_history_is_validated_and_templated_once() -> None:
    cache = MessageCache()
    first = cache.request(_body(HISTORY[:2]))
    first_dicts = cache.template(first.messages)
    second = cache.request(_body([*HISTORY, {"role": "user", "content": "more"}]))
    second_dicts = cache.template(second.messages)
    assert second.messages[:2] == first.messages[:2]
    assert all(a is b for a, b in zip(second.messages[:2], first.messages, strict=False))
    assert all(a is b for a, b in zip(second_dicts[:2], first_dicts, strict=False))
    assert second_dicts == template_messages(second.messages)  # what no cache would give


def test_an_edited_earlier_message_is_validated_afresh() -> None:
    cache = MessageCache()
    cache.template(cache.request(_body(HISTORY)).messages)
    edited = [dict(m) for m in HISTORY]
    edited[1]["content"] = "go on"  # a summarising agent rewrote it
    req = cache.request(_body(edited))
    assert req.messages[1].content == "go on"
    assert cache.template(req.messages)[1]["content"] == "go on"
    edited[1]["content"] = 7  # and a bad edit is named, as without the cache
    with pytest.raises(ApiError) as caught:
        cache.request(_body(edited))
    assert caught.value.param == "messages.1.content"


def test_a_refused_call_leaves_the_cache_as_it_was() -> None:
    cache = MessageCache()
    kept = cache.request(_body(HISTORY)).messages
    with pytest.raises(ApiError, match="n must be 1"):
        cache.request({**_body(HISTORY), "n": 2})
    assert cache.request(_body(HISTORY)).messages[0] is kept[0]


def test_a_call_that_changes_only_its_messages_equals_a_whole_validation() -> None:
    """The agent loop's call (same fields, more messages) skips the request-level checks: it
    must give the request a fresh validation gives, and still name a bad new message."""
    cache = MessageCache()
    fields = {"model": "m", "temperature": 0.5, "max_tokens": 9, "stop": ["END"]}
    cache.request({**_body(HISTORY[:2]), **fields})
    later = [*HISTORY, {"role": "user", "content": "more"}]
    req = cache.request({**_body(later), **fields})
    assert req == MessageCache().request({**_body(later), **fields})
    assert (req.temperature, req.max_tokens, req.stop_strings()) == (0.5, 9, ("END",))
    with pytest.raises(ApiError) as caught:
        cache.request({**_body([*later, {"role": "user", "content": 7}]), **fields})
    assert caught.value.param == "messages.5.content"
    with pytest.raises(ApiError) as caught:  # a changed field is checked again
        cache.request({**_body(later), **fields, "presence_penalty": 1.5})
    assert caught.value.param == "presence_penalty"
    with pytest.raises(ApiError):
        cache.request({**_body([]), **fields})  # no messages: refused, not copied
