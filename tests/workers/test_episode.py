"""The episode loop's own helpers (the loop itself runs in the farm and alignment tests)."""

from __future__ import annotations

from typing import Any

from envs import Env
from workers.episode import ChatEnv, _declares_chat


class _Partial:
    system_prompt = "s"
    tools: list[dict[str, Any]] | None = None  # no action_vocabulary


class _Instance:
    def __init__(self) -> None:
        self.system_prompt, self.tools, self.action_vocabulary = None, None, ("a",)


def test_declares_chat_is_the_protocol_check() -> None:
    """`_declares_chat` answers as `isinstance(env, ChatEnv)` does, without its cost."""
    for env in (Env(), _Partial(), _Instance(), object(), "text"):
        assert _declares_chat(env) == isinstance(env, ChatEnv)
    assert _declares_chat(Env()) and _declares_chat(_Instance()) and not _declares_chat(_Partial())
