"""`farm demo`'s training settings: one table keyed by (model family, environment).

Each row says what a model family trains an environment with on two CPU cores, and what
measured it. `model_family` tells the family of a model directory from its config.json
(the architecture sizes, so a copy or a pushed version of the weights counts too);
`lookup(family, env_name)` picks the row: the exact pair, else the family's row for any
environment (``"*"``), else a `ConfigError` that lists the measured pairs. The demo renders a
row into the learner's and the workers' flags (`learner_args`, `worker_args`), and, for an
environment with a held-out split (`heldout_lines`), into the flags of an evaluation of that
split before training and after the last step.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from farm.errors import ConfigError

TINY, ANY_ENV = "tiny", "*"

# config.json fields that tell a family: SmolLM2-135M's sizes, and `inference.tiny`'s defaults.
FAMILIES: dict[str, dict[str, int]] = {
    "smollm2": {"hidden_size": 576, "num_hidden_layers": 30, "vocab_size": 49152},
    TINY: {"hidden_size": 64, "num_hidden_layers": 2},
}


@dataclass(frozen=True)
class DemoSettings:
    """One row of the table: how a family trains an environment in the demo."""

    measured: str  # what measured these settings (shown in the summary)
    group_size: int
    groups_per_batch: int
    learning_rate: float
    max_tokens: int  # completion tokens per turn, for training and the held-out eval
    temperature: float  # sampling temperature, for training and the held-out eval
    max_steps: int
    time_limit_s: float  # the farm stops after this, from start-up
    stop_when_solved: bool
    eval_samples: int = 4  # k of the held-out eval's mean@k and pass@k
    # env-spec kwargs of this row, where the user's spec does not set them
    env_defaults: tuple[tuple[str, Any], ...] = ()
    sandbox_backend: str | None = None  # the workers' sandbox, unless the user names one
    learner_extra: tuple[str, ...] = ()  # further learner flags of this row
    worker_extra: tuple[str, ...] = ()  # further worker flags of this row


_TOY = DemoSettings(
    measured="in-process (tests/learner/inprocess.py), seeds 0-2: a 10-step mean of 0.6 at "
    "steps 55, 51, 57; 4 prompts a step took 200+ steps, lr 5e-3 or 1e-2 collapsed on 1 seed of 3",
    group_size=8,
    groups_per_batch=16,
    learning_rate=3e-3,
    max_tokens=1,  # the toy answer is one digit
    temperature=1.0,
    max_steps=500,
    time_limit_s=270.0,
    stop_when_solved=True,
    learner_extra=("--lr-warmup-steps", "10", "--max-staleness", "1"),
)

SETTINGS: dict[tuple[str, str], DemoSettings] = {
    (TINY, ANY_ENV): _TOY,
    (TINY, "toy"): _TOY,
    # lookup must copy the tool's answer from its second turn: an entropy bonus and an lr
    # decayed over the run keep it from collapsing on a wrong digit first
    (TINY, "lookup"): DemoSettings(
        measured="in-process, seeds 0-2: last 10-step mean 0.94, 0.92, 0.69 after 250 steps "
        "(tests/learner/test_learning.py)",
        group_size=8,
        groups_per_batch=16,
        learning_rate=3e-3,
        max_tokens=1,
        temperature=1.0,
        max_steps=500,
        time_limit_s=270.0,
        stop_when_solved=True,
        learner_extra=(
            *_TOY.learner_extra,
            *("--entropy-coef", "0.03", "--lr-schedule", "cosine"),
            *("--lr-decay-steps", "250", "--min-lr-ratio", "0.1"),
        ),
    ),
    # 12 tokens hold "7 + 5 = 12" and cut the rambling after it; on policy (staleness 0) as
    # measured; no checkpoint before the last step (one is 1.6 GB with Adam's moments)
    ("smollm2", "arith"): DemoSettings(
        measured="in-process, seeds 0-2: held-out mean@4 0.06 -> 0.60-0.66 after 5 steps "
        "(tests/learner/test_learning_smollm2.py); through the farm by hand 0.04 -> 0.64 "
        "after 8 steps in 2 min 10 s (issue 41)",
        group_size=8,
        groups_per_batch=4,
        learning_rate=2e-5,
        max_tokens=12,
        temperature=1.0,
        max_steps=8,
        time_limit_s=900.0,  # a safety net: the 8 steps end it (a loaded machine: ~60 s a step)
        stop_when_solved=False,
        learner_extra=("--micro-batch-size", "8", "--max-staleness", "0"),
    ),
    # calc: a call and its answer fit 64 tokens a turn; the prompt (schema, two worked
    # exchanges) is ~380 tokens, so micro-batches of 4; each held-out problem sampled twice
    ("smollm2", "calc"): DemoSettings(
        measured="through the farm, seeds 0-2: held-out mean@2 0.14 -> 0.96-0.98, tool calls "
        '24% -> 99%, 18-20 min (BENCHMARKS.md, "farm demo --model smollm2 --env calc")',
        group_size=8,
        groups_per_batch=4,
        learning_rate=2e-5,
        max_tokens=64,
        temperature=1.0,
        max_steps=5,  # the training reward went 0.06, 0.72, 0.84 in steps 1-3 (seed 0)
        time_limit_s=1800.0,
        stop_when_solved=False,
        eval_samples=2,
        # the calculator runs in a bubblewrap jail, as a tool of the farm's sandbox pool: no
        # image to build first (`--sandbox-backend docker` runs it in Docker instead)
        env_defaults=(("calculator", "sandbox"),),
        sandbox_backend="bwrap",
        learner_extra=("--micro-batch-size", "4", "--max-staleness", "0"),
        # the 80-episode evaluation queues ~80 requests of ~400-token prompts on the CPU
        # server: at the default 60 s a request, one evaluation timed out whole on a loaded
        # machine; with these limits all three seeds' evaluations passed
        worker_extra=(
            *("--tool-parser", "hermes", "--inference-request-timeout-s", "300"),
            *("--inference-retry-budget-s", "900"),
        ),
    ),
}


def lookup(family: str, env_name: str) -> tuple[str, DemoSettings]:
    """The row for (`family`, `env_name`) and its name ("family/env"); ConfigError if none."""
    for key in ((family, env_name), (family, ANY_ENV)):
        if key in SETTINGS:
            return "/".join(key), SETTINGS[key]
    measured = ", ".join(f"{f}/{e}" for f, e in SETTINGS)
    raise ConfigError(
        f"farm demo has no settings for the model family {family!r} on {env_name!r} "
        f"(measured: {measured}); train it with `farm up` and your own --learner-arg/--worker-arg"
    )


def model_family(model: Path | None) -> str:
    """The family of the model directory `model` (None: the tiny model the demo builds)."""
    if model is None:
        return TINY
    try:
        config = json.loads((model / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"--model {model}: no readable config.json ({exc})") from None
    for family, fields in FAMILIES.items():
        if all(config.get(k) == v for k, v in fields.items()):
            return family
    raise ConfigError(
        f"--model {model}: farm demo knows the families {', '.join(FAMILIES)} "
        "(by their config.json sizes), not this model's; train it with `farm up`"
    )


def env_spec_of(row: DemoSettings, env_spec: str) -> str:
    """`env_spec` with the row's `env_defaults` added where the spec does not set them."""
    if not row.env_defaults:
        return env_spec
    name, _, raw = env_spec.partition("@")
    given: dict[str, Any] = json.loads(raw) if raw else {}
    return f"{name}@{json.dumps(dict(row.env_defaults) | given)}"


def learner_args(row: DemoSettings) -> list[str]:
    """The learner flags of `row` (the user's own --learner-arg follow and win)."""
    return [
        *("--group-size", str(row.group_size), "--groups-per-batch", str(row.groups_per_batch)),
        *("--learning-rate", str(row.learning_rate), "--checkpoint-interval", "1000"),
        *row.learner_extra,
    ]


def worker_args(row: DemoSettings) -> list[str]:
    return [
        *("--max-tokens", str(row.max_tokens), "--temperature", str(row.temperature)),
        *row.worker_extra,
    ]


def eval_args(row: DemoSettings, tasks: Path, eval_dir: Path, max_steps: int) -> list[str]:
    """Learner flags that score the held-out set `tasks` before the first step and after
    step `max_steps` (the last), with the row's sampling; results in `eval_dir`."""
    return [
        *("--eval-tasks", f"heldout={tasks}", "--eval-before-train"),
        *("--eval-interval", str(max_steps), "--eval-samples", str(row.eval_samples)),
        *("--eval-temperature", str(row.temperature), "--eval-max-tokens", str(row.max_tokens)),
        *("--eval-dir", str(eval_dir)),
    ]


def heldout_lines(env_spec: str) -> list[str] | None:
    """A task file naming every held-out problem of `env_spec`'s environment once (by
    index), or None for an environment without a held-out split."""
    name, _, raw = env_spec.partition("@")
    if name not in ("arith", "calc"):
        return None
    from envs import arith, calc

    kwargs: dict[str, Any] = json.loads(raw) if raw else {}
    kwargs.pop("split", None)
    try:
        return (
            arith.split_lines("heldout", **kwargs)
            if name == "arith"
            else calc.split_lines(**kwargs)
        )
    except ValueError as exc:  # pydantic's: a bad kwarg, which the learner reports too
        raise ConfigError(f"--env {env_spec}: {exc}") from None
