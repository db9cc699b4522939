"""The ``lookup`` environment: a multi-turn tool task whose answer only a tool call reveals.

Each episode draws a fresh record, a digit stored under a one-letter key, from its seed.
The first observation names the key (``"k"``); nothing in it predicts the digit. The
agent either calls the lookup tool, whose observation is the stored digit (``"7"``), or
answers with a digit, which ends the episode with reward 1 if it is the stored one, else
0. So a policy that guesses scores about 10%, and one that looks up, then copies what
the tool returned scores 100%: the reward rises above chance only when the answer comes
from the tool's observation, across two turns.

Actions are one token each for the tiny byte-level model (``action_vocabulary`` is the
ten digits plus ``"?"``): ``"?"`` calls the tool, a digit answers. A Hermes/OpenAI call
of a tool named ``lookup`` (``<tool_call>{"name": "lookup", "arguments": {}}</tool_call>``)
is the same call, for models that write tool calls. Anything else is a format error
(reward 0, the episode goes on). After ``max_turns`` actions without an answer the
episode is truncated (``truncated_by="max_turns"``).
"""

from __future__ import annotations

import random
import string
from typing import Any

import pydantic

from broker.messages import ErrorCategory
from envs.api import Env, ResetResult, StepResult
from envs.errors import EnvStateError
from envs.parsing import parse_tool_calls
from envs.toy import DIGITS, TRAILING_SPECIALS

LOOKUP_ACTION = "?"
_BAD_ACTION = "error: answer a digit or call ?"
_NOT_YET = "error: call ? first"


class LookupConfig(pydantic.BaseModel):
    """Configuration of the lookup environment."""

    model_config = pydantic.ConfigDict(extra="forbid", frozen=True)

    max_turns: int = pydantic.Field(
        3, ge=2, le=32, description="actions before the episode is truncated (2 = look up, answer)"
    )
    instructions: bool = pydantic.Field(
        False, description="add a system prompt explaining the task (costs tokens per step)"
    )


class LookupEnv(Env):
    """Look the key up with the tool, then answer with the digit it returned."""

    action_vocabulary = (*DIGITS, LOOKUP_ACTION)

    def __init__(self, config: LookupConfig | None = None) -> None:
        self.config = config or LookupConfig()
        self.system_prompt = (
            "A digit is stored under the key shown. Reply ? to look it up, then reply "
            "with that digit only." if self.config.instructions else None
        )  # fmt: skip
        self._value: int | None = None
        self._turns = 0
        self._looked_up = False

    def reset(self, *, seed: int | None = None) -> ResetResult:
        rng = random.Random(seed)
        key = rng.choice(string.ascii_lowercase)
        self._value, self._turns, self._looked_up = rng.randrange(10), 0, False
        return key, {"key": key}

    def step(self, action: Any) -> StepResult:
        if self._value is None:
            raise EnvStateError("lookup: step() called before reset() or after the episode ended")
        self._turns += 1
        text = TRAILING_SPECIALS.sub("", str(action)).strip()
        info: dict[str, Any] = {"looked_up": self._looked_up, "answer": str(self._value)}
        if text in DIGITS and self._looked_up:
            correct = text == str(self._value)
            self._value = None
            return "", 1.0 if correct else 0.0, True, False, {**info, "correct": correct}
        if _is_lookup(text):
            self._looked_up = True
            observation = str(self._value)
            info["looked_up"] = True
        elif text in DIGITS:
            observation = _NOT_YET
            info.update(error=ErrorCategory.FORMAT, error_detail="answered before looking up")
        else:
            observation = _BAD_ACTION
            info.update(error=ErrorCategory.FORMAT, error_detail=f"not a digit or ?: {text!r}")
        if self._turns >= self.config.max_turns:
            self._value = None
            return observation, 0.0, False, True, {**info, "truncated_by": "max_turns"}
        return observation, 0.0, False, False, info


def _is_lookup(text: str) -> bool:
    """``?`` or one tool call of ``lookup`` in a syntax `envs.parsing` understands."""
    if text == LOOKUP_ACTION:
        return True
    parsed = parse_tool_calls(text)
    return parsed.error is None and [c.name for c in parsed.calls] == ["lookup"]


def make_lookup(max_turns: int = 3, instructions: bool = False) -> LookupEnv:
    """Registry factory for ``lookup@{"max_turns": 3, "instructions": false}``."""
    return LookupEnv(LookupConfig(max_turns=max_turns, instructions=instructions))
