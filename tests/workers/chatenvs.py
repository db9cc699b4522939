"""`wk-toolturns`: a three-turn tool episode for the chat-template tests (imported in-process
and by `python -m workers --env-modules tests.workers.chatenvs`).

Turn 1 the model talks (anything but a call): the env asks for the call, as a user message.
Turn 2 the model calls ``lookup(key)``: the result comes back as a ``tool`` message answering
the call's id. Turn 3 the model answers: reward 1 when the answer (reasoning already split off
by the worker) is the digit the tool returned, 0.5 when the digit is only in the answer or its
reasoning (a random model's groups then differ, so they train), and the episode ends.

``forced_call`` (for a tiny random model, which cannot write a family's call syntax): turn 2
is the call whatever it says, as `lookup`'s fixed protocol does. ``vocabulary`` restricts the
answer turns' tokens to the digits (plus ``<think>``/``</think>`` with ``thinking``), so that a
random model's answer can be right. Every action the env receives is kept in ``ACTIONS[seed]``.
"""

from __future__ import annotations

import random
import string
from typing import Any

import envs
from envs import Env
from envs.parsing import parse_tool_calls
from envs.tools import function_schema

ACTIONS: dict[int, list[Any]] = {}  # seed -> every action received, in order
DIGITS = tuple(string.digits)


def lookup(key: str) -> str:
    """Look a key up.

    Args:
        key: the key to look up
    """
    return key


TOOLS = [function_schema(lookup)]


class ToolTurns(Env):
    """Talk, call lookup, answer with what it returned."""

    tools = TOOLS

    def __init__(self, forced_call: bool = False, vocabulary: bool = False, thinking: bool = False):
        self.forced_call, self.vocabulary, self.thinking = forced_call, vocabulary, thinking
        self.action_vocabulary: tuple[str, ...] | None = None
        self.turn, self.key, self.value, self.seed = 0, "", "", 0

    def reset(self, *, seed: int | None = None) -> tuple[str, dict[str, Any]]:
        rng = random.Random(seed)
        self.seed, self.turn = seed or 0, 0
        self.key, self.value = rng.choice(string.ascii_lowercase), rng.choice(DIGITS)
        ACTIONS.setdefault(self.seed, [])
        self._narrow()
        return f"What is stored under key {self.key}? Use the lookup tool, then answer.", {}

    def _narrow(self) -> None:
        if self.vocabulary:
            extra = ("<think>", "</think>") if self.thinking else ()
            self.action_vocabulary = (*DIGITS, *extra) if self.turn != 1 else ("<tool_call>",)

    def step(self, action: Any) -> tuple[Any, float, bool, bool, dict[str, Any]]:
        ACTIONS[self.seed].append(action)
        self.turn += 1
        self._narrow()
        calls = parse_tool_calls(action).calls
        if self.turn == 1:
            return "Now call the lookup tool.", 0.0, False, False, {}
        if self.turn == 2:
            call = calls[0] if calls else None
            if call is None and not self.forced_call:
                return "That was no call.", 0.0, False, True, {"error": "format"}
            result = {"role": "tool", "content": self.value, "name": "lookup"}
            if call is not None and call.id:
                result["tool_call_id"] = call.id
            return result, 0.0, False, False, {}
        answer = str(action).strip()
        seen = self.value in answer or self.value in getattr(action, "reasoning", "")
        reward = 1.0 if answer == self.value else 0.5 if seen else 0.0
        return "", reward, True, False, {"answer": answer}


envs.register("wk-toolturns", ToolTurns, overwrite=True)
