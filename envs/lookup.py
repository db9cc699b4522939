"""The ``lookup`` environment: a two-turn tool task whose answer only the tool reveals.

Each episode draws a fresh record, a digit stored under a one-letter key, from its
seed. The first observation names the key (``"k"``); nothing in it predicts the digit.
The agent's first action is a call of the lookup tool; the tool's observation is the
stored digit (``"7"``). The agent's next action is its answer: reward 1 if it is the
stored digit, else 0, and the episode ends. A policy that ignores the tool's
observation scores about 10%; one that answers with what the tool returned scores
100%. So the reward rises above chance only when the model learns to use an
observation from an earlier turn of its own episode.

Actions are one token each for the tiny byte-level model (``action_vocabulary`` is
the ten digits plus ``"?"``).

- ``choose=false`` (default): the first turn is the tool call whatever it says (a
  fixed protocol: query, then answer), so the model learns only to use the result. The
  action vocabulary follows the protocol: ``"?"`` alone on the first turn, the digits on
  the answer turn. The worker reads it before every turn, so the forced turn samples the
  call (no stray digit lands in the context), and it carries no gradient worth the name.
- ``choose=true``: the agent decides. ``"?"`` (or a Hermes/OpenAI call of a tool
  named ``lookup``: ``<tool_call>{"name": "lookup", "arguments": {}}</tool_call>``)
  calls the tool; a digit before any lookup is a format error (reward 0, the episode
  goes on), so only an answer backed by the tool can score. Chance is ~1.5%, and the
  tiny model does not find the call by itself within minutes (measured: 120 GRPO steps
  of 64 episodes stayed below 0.1); it is the harder variant for larger models.

After ``max_turns`` actions without an answer the episode is truncated
(``truncated_by="max_turns"``).
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
_CHOICES = (*DIGITS, LOOKUP_ACTION)
_BAD_ACTION = "error: answer a digit or call ?"
_NOT_YET = "error: call ? first"


class LookupConfig(pydantic.BaseModel):
    """Configuration of the lookup environment."""

    model_config = pydantic.ConfigDict(extra="forbid", frozen=True)

    max_turns: int = pydantic.Field(
        3, ge=2, le=32, description="actions before the episode is truncated (2 = look up, answer)"
    )
    choose: bool = pydantic.Field(
        False, description="the agent must call the tool itself ('?') before answering"
    )
    instructions: bool = pydantic.Field(
        False, description="add a system prompt explaining the task (costs tokens per step)"
    )


class LookupEnv(Env):
    """Look the key up with the tool, then answer with the digit it returned."""

    def __init__(self, config: LookupConfig | None = None) -> None:
        self.config = config or LookupConfig()
        self.action_vocabulary: tuple[str, ...] = _CHOICES
        self.system_prompt = (
            "A digit is stored under the key shown. Reply ? to look it up, then reply "
            "with that digit only."
            if self.config.instructions
            else None
        )
        self._value: int | None = None
        self._turns = 0
        self._looked_up = False

    def reset(self, *, seed: int | None = None) -> ResetResult:
        rng = random.Random(seed)
        key = rng.choice(string.ascii_lowercase)
        self._value, self._turns, self._looked_up = rng.randrange(10), 0, False
        self.action_vocabulary = _CHOICES if self.config.choose else (LOOKUP_ACTION,)
        return key, {"key": key}

    def step(self, action: Any) -> StepResult:
        if self._value is None:
            raise EnvStateError("lookup: step() called before reset() or after the episode ended")
        self._turns += 1
        text = TRAILING_SPECIALS.sub("", str(action)).strip()
        info: dict[str, Any] = {"looked_up": self._looked_up, "answer": str(self._value)}
        if not self.config.choose and self._turns == 1:
            text = LOOKUP_ACTION  # the protocol: the first action is the tool call
        if text in DIGITS and self._looked_up:
            correct = text == str(self._value)
            self._value = None
            return "", 1.0 if correct else 0.0, True, False, {**info, "correct": correct}
        if _is_lookup(text):
            self._looked_up = True
            observation = str(self._value)
            info["looked_up"] = True
            if not self.config.choose:
                self.action_vocabulary = DIGITS
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


def make_lookup(max_turns: int = 3, choose: bool = False, instructions: bool = False) -> LookupEnv:
    """Registry factory for ``lookup@{"max_turns": 3, "choose": false, "instructions": false}``."""
    return LookupEnv(LookupConfig(max_turns=max_turns, choose=choose, instructions=instructions))
