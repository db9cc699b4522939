"""The ``toy`` environment: a one-digit task a tiny model learns on CPU in minutes.

Single turn: the observation is a few characters, the answer is one digit
(``action_vocabulary`` is the ten digit strings, so a worker restricts sampling to
them and a random policy scores about 10%). Reward 1 for the right digit, else 0;
the episode terminates after one step.

Difficulty levels (observation → answer):

- 0 (default): ``"7"`` → ``7``  (copy the digit; learnt fastest)
- 1: ``"3+4"`` → ``7``  (single-digit addition or subtraction, result in 0..9)
- 2: ``"3+4+9"`` → ``6``  (last digit of a three-term sum)
- 3: ``"3*4+9"`` → ``1``  (last digit of a*b+c)
"""

from __future__ import annotations

import random
import re
from typing import Any

import pydantic

from envs.api import Env, ResetResult, StepResult
from envs.errors import EnvStateError
from envs.registry import spec_config

# A worker that decodes without skipping special tokens sends "7<|im_end|>".
TRAILING_SPECIALS = re.compile(r"(?:<\|[A-Za-z_]+\|>\s*)+$")

DIGITS: tuple[str, ...] = tuple(str(d) for d in range(10))

_INSTRUCTIONS = (
    "Answer with a single digit and nothing else.",
    "Compute the expression and answer with the single-digit result.",
    "Answer with the last digit of the sum.",
    "Answer with the last digit of the result.",
)


class ToyConfig(pydantic.BaseModel):
    """Configuration of the toy environment."""

    model_config = pydantic.ConfigDict(extra="forbid", frozen=True)

    difficulty: int = pydantic.Field(
        0, ge=0, le=3, description="0 copy, 1 small arithmetic, 2 three-term sum, 3 a*b+c (mod 10)"
    )
    instructions: bool = pydantic.Field(
        False, description="add a system prompt explaining the task (costs tokens per step)"
    )


def _puzzle(rng: random.Random, difficulty: int) -> tuple[str, int]:
    """Draw an observation and its answer digit."""
    if difficulty == 0:
        d = rng.randrange(10)
        return str(d), d
    if difficulty == 1:
        if rng.random() < 0.5:
            a = rng.randrange(10)
            b = rng.randrange(10 - a)
            return f"{a}+{b}", a + b
        a = rng.randrange(10)
        b = rng.randrange(a + 1)
        return f"{a}-{b}", a - b
    a, b, c = (rng.randrange(10) for _ in range(3))
    if difficulty == 2:
        return f"{a}+{b}+{c}", (a + b + c) % 10
    return f"{a}*{b}+{c}", (a * b + c) % 10


class ToyEnv(Env):
    """One-step digit task; see the module docstring for the levels."""

    action_vocabulary = DIGITS

    def __init__(self, config: ToyConfig | None = None) -> None:
        self.config = config or ToyConfig()
        self.system_prompt = (
            _INSTRUCTIONS[self.config.difficulty] if self.config.instructions else None
        )
        self._answer: int | None = None

    def reset(self, *, seed: int | None = None) -> ResetResult:
        rng = random.Random(seed)
        observation, self._answer = _puzzle(rng, self.config.difficulty)
        return observation, {"difficulty": self.config.difficulty}

    def step(self, action: Any) -> StepResult:
        if self._answer is None:
            raise EnvStateError("toy: step() called before reset() or after the episode ended")
        answer, self._answer = self._answer, None
        correct = TRAILING_SPECIALS.sub("", str(action)).strip() == str(answer)
        info = {"correct": correct, "answer": str(answer)}
        return "", 1.0 if correct else 0.0, True, False, info


@spec_config(ToyConfig)
def make_toy(difficulty: int = 0, instructions: bool = False) -> ToyEnv:
    """Registry factory for ``toy@{"difficulty": 0..3, "instructions": bool}``."""
    return ToyEnv(ToyConfig(difficulty=difficulty, instructions=instructions))
