"""The ``arith`` environment: small-number arithmetic, answered with the number and then stop.

Built for a real pretrained chat model (SmolLM2-135M-Instruct, `inference.models`): single
turn, the observation is ``"What is 7+5? Answer with the number only."``, and the reward is
1 when the answer is the last thing the reply says (``"12"``, ``"7 + 5 = 12"``, ``"The
answer is 12."``; whitespace, ``.`` and ``!`` may follow), else 0. With ``strict`` the reply
must be the number alone. The episode terminates after one step.

Why this task: the base model knows most single-digit sums but does not stop after the
answer; it rambles on (``"7 + 5 = 12\\n\\nThis is a classic example of"``) until the turn is
cut at ``max_tokens``, or it talks around the sum. Measured on SmolLM2 at temperature 1.0,
12 new tokens: 13% of replies end with the right number, none is the bare number, and a
third stop on ``<|im_end|>`` (docs/envs.md). What RL has to fix is mostly the stopping,
which the model already does sometimes, so a few dozen steps on two cores can move it.

Splits: the problems are every ``a op b`` with ``0 <= a, b <= max_operand`` (for ``-``,
``a >= b``), shuffled by a fixed seed; the first ``heldout_fraction`` of them are the
``heldout`` split and the rest the ``train`` split. The split depends only on
``max_operand``, ``ops`` and ``heldout_fraction``, so ``arith@{"split": "heldout"}`` next to
``arith`` names disjoint problems, and an evaluation passes the held-out spec as its own task.
``reset(seed)`` draws one problem of the split from the seed; a task whose row names a
problem (``{"index": i}``, the split's i-th) gets that one instead, so an eval set that lists
every index of the held-out split (`split_lines`) scores each problem exactly once.
"""

from __future__ import annotations

import functools
import json
import random
import re
from typing import Any, Literal

import pydantic

from envs.api import Env, ResetResult, StepResult
from envs.errors import EnvSpecError, EnvStateError
from envs.registry import spec_config
from envs.toy import TRAILING_SPECIALS

SPLIT_SEED = 26  # fixed for ever: changing it moves problems between the splits
_FINAL_NUMBER = re.compile(r"(-?\d+)[\s.!]*$")

Problem = tuple[int, str, int]


class ArithConfig(pydantic.BaseModel):
    """Configuration of the arith environment."""

    model_config = pydantic.ConfigDict(extra="forbid", frozen=True)

    split: Literal["train", "heldout"] = pydantic.Field(
        "train", description="which problems: the training split or the held-out one"
    )
    max_operand: int = pydantic.Field(9, ge=1, le=99, description="operands are 0..max_operand")
    ops: Literal["+", "-", "+-"] = pydantic.Field("+", description="the operators drawn from")
    heldout_fraction: float = pydantic.Field(
        0.2, gt=0.0, lt=1.0, description="share of the problems held out of training"
    )
    strict: bool = pydantic.Field(
        False, description="the reply must be the number alone (default: end with the number)"
    )


def answer_of(problem: Problem) -> int:
    a, op, b = problem
    return a + b if op == "+" else a - b


@functools.lru_cache(maxsize=16)
def split_problems(max_operand: int, ops: str, heldout_fraction: float) -> dict[str, list[Problem]]:
    """Every problem of the space, in the train or the held-out split (disjoint, both non-empty)."""
    space = [
        (a, op, b)
        for op in ops
        for a in range(max_operand + 1)
        for b in range(max_operand + 1)
        if op == "+" or a >= b
    ]
    random.Random(SPLIT_SEED).shuffle(space)
    cut = min(max(round(len(space) * heldout_fraction), 1), len(space) - 1)
    return {"heldout": space[:cut], "train": space[cut:]}


def score(reply: str, answer: int, *, strict: bool) -> float:
    """1.0 when the reply is the answer (strict) or ends with it, else 0.0."""
    text = TRAILING_SPECIALS.sub("", reply).strip()
    if strict:
        return 1.0 if text == str(answer) else 0.0
    final = _FINAL_NUMBER.search(text)
    return 1.0 if final is not None and int(final.group(1)) == answer else 0.0


class ArithEnv(Env):
    """One arithmetic question; see the module docstring for the reward and the splits."""

    def __init__(self, config: ArithConfig | None = None) -> None:
        self.config = config or ArithConfig()
        c = self.config
        self.problems = split_problems(c.max_operand, c.ops, c.heldout_fraction)[c.split]
        self._problem: Problem | None = None

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> ResetResult:
        row = (options or {}).get("row")
        if row is None:
            self._problem = random.Random(seed).choice(self.problems)
        else:
            self._problem = self.problems[_index(row, len(self.problems))]
        a, op, b = self._problem
        observation = f"What is {a}{op}{b}? Answer with the number only."
        return observation, {"split": self.config.split, "problem": f"{a}{op}{b}"}

    def step(self, action: Any) -> StepResult:
        if self._problem is None:
            raise EnvStateError("arith: step() called before reset() or after the episode ended")
        answer, self._problem = answer_of(self._problem), None
        reward = score(str(action), answer, strict=self.config.strict)
        return "", reward, True, False, {"correct": reward == 1.0, "answer": str(answer)}


def _index(row: Any, count: int) -> int:
    index = row.get("index") if isinstance(row, dict) else None
    if not isinstance(index, int) or isinstance(index, bool) or not 0 <= index < count:
        raise EnvSpecError(
            f"arith: a row names a problem as {{'index': 0..{count - 1}}}, got {row!r}"
        )
    return index


def split_lines(split: str = "heldout", **kwargs: Any) -> list[str]:
    """A task file (JSONL lines) naming every problem of `split` once, by its index; `kwargs`
    are the other `ArithConfig` fields. ``--eval-tasks heldout=FILE`` then scores each once."""
    config = ArithConfig(split=split, **kwargs)  # type: ignore[arg-type]
    count = len(split_problems(config.max_operand, config.ops, config.heldout_fraction)[split])
    spec = "arith@" + json.dumps(config.model_dump(exclude_defaults=True) | {"split": split})
    return [json.dumps({"env_spec": spec, "row": {"index": i}}) for i in range(count)]


@spec_config(ArithConfig)
def make_arith(
    split: str = "train",
    max_operand: int = 9,
    ops: str = "+",
    heldout_fraction: float = 0.2,
    strict: bool = False,
) -> ArithEnv:
    """Registry factory for ``arith@{"split": "train"|"heldout", "max_operand": 9, "ops": "+",
    "heldout_fraction": 0.2, "strict": false}``."""
    return ArithEnv(
        ArithConfig(
            split=split,
            max_operand=max_operand,
            ops=ops,
            heldout_fraction=heldout_fraction,
            strict=strict,
        )
    )
