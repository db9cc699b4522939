"""`python -m learner evaluate` and `filter`: one evaluation through a running farm, and the
pass-rate filter of a task file built on it.

`filter` runs each task of ``--tasks`` ``--samples`` times the same way (at the workers'
sampling by default: temperature 1) and writes the tasks whose pass rate lies in
``--keep LO:HI`` to ``--out``, the rate in each row's ``meta.pass_rate``, as CodeGym does.

It issues every row of every ``--eval-tasks NAME=FILE`` set to the run's tasks streams (the
workers serve it as any task; the servers serve whatever weights they hold: a checkpoint
served with ``python -m inference --model DIR``, or the learner's latest push), collects
the groups from the eval streams through a consumer group of its own, prints a table and
removes its group. Exit codes: 0 every row scored; 2 a bad configuration or eval set;
3 rows missing at the time limit or spoiled by the infrastructure (listed apart from the
score, never counted as the model's failures).
"""

from __future__ import annotations

import importlib
import json
import logging
import sys
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar

from pydantic import Field

from broker.run import RunFields
from launch.runner import Role, RoleContext, start
from launch.settings import LogLevel, RoleConfig, section
from learner.config import EvalConfig
from learner.dataspec import DataConfig
from learner.errors import ConfigError, TaskSourceError

log = logging.getLogger("learner")

COLUMNS = ("rows", "scored_rows", "infra_failed_rows", "mean_at_k", "pass_at_1")


class _RunConfig(RunFields, RoleConfig):
    """The run a one-off command works on: shared by `evaluate` and `filter`."""

    role: ClassVar[str] = "learner"
    error: ClassVar[type[Exception]] = ConfigError

    log_level: LogLevel = Field(
        "WARNING", description="log level"
    )  # a command's output is its table


class EvaluateConfig(_RunConfig):
    """Everything `python -m learner evaluate` needs."""

    evaluation: EvalConfig = section(EvalConfig)
    data: DataConfig = section(DataConfig)


def table(result: object, k: int) -> str:
    """The result as a plain-text table, one line per set and per set/env."""
    from learner.evaluation import EvalResult

    assert isinstance(result, EvalResult)
    cols = (*COLUMNS, f"pass_at_{k}") if k > 1 else COLUMNS
    width = max([len("set"), *(len(key) for key in result.sets)])
    lines = [f"{'set':<{width}}  " + "  ".join(f"{c:>17}" for c in cols)]
    for key, figures in result.sets.items():
        cells = [f"{figures.get(c, 0.0):>17.4g}" for c in cols]
        lines.append(f"{key:<{width}}  " + "  ".join(cells))
    lines.append(
        f"tasks {result.tasks}, missing {result.missing_rows}, weight versions "
        f"{result.weight_versions[0]}..{result.weight_versions[1]}, "
        f"{result.seconds:.1f}s"
    )
    return "\n".join(lines)


async def _main(ctx: RoleContext[EvaluateConfig]) -> int:
    from broker.connection import RedisSettings, connect
    from broker.keys import RunKeys
    from broker.policy import current_policy
    from learner.evaluation import Evaluator, load_sets

    cfg = ctx.config
    if not cfg.evaluation.eval_tasks:
        print("error: evaluate needs --eval-tasks NAME=FILE", file=sys.stderr)
        return 2
    try:
        for name in cfg.env_modules:
            importlib.import_module(name)
        sets = load_sets(cfg.evaluation, cfg.data)
    except (TaskSourceError, ImportError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    redis = await connect(RedisSettings.from_url(cfg.redis_url))
    keys = RunKeys(cfg.run, cfg.partitions)
    name = f"evaluate-{uuid.uuid4().hex[:8]}"
    evaluator = Evaluator(redis, keys, sets, cfg.evaluation, name)
    try:
        await evaluator.start()
        policy = await current_policy(redis, keys)
        version = policy.version if policy is not None else 0
        result = await evaluator.run_round(-1, version)
    finally:
        await evaluator.consumer.destroy_group()  # nothing reads this evaluation's group again
        await redis.aclose()
    print(table(result, cfg.evaluation.eval_samples))
    infra = sum(f["infra_failed_rows"] for key, f in result.sets.items() if "/" not in key)
    return 3 if result.missing_rows or infra else 0


ROLE = Role(
    name="learner evaluate",
    config=EvaluateConfig,
    main=_main,
    description="One evaluation of the served weights through the farm (docs/learner.md).",
)


def main(argv: list[str]) -> int:
    return start(ROLE, argv)


class FilterConfig(_RunConfig):
    """Everything `python -m learner filter` (`farm filter`) needs."""

    tasks: Path = Field(description="task file to filter (JSONL, Parquet, a datasets directory)")
    out: Path = Field(description="where the kept rows go (JSONL, each with its pass rate)")
    samples: int = Field(4, ge=1, le=4096, description="k: samples per task")
    keep: str = Field(
        "0.1:0.9", pattern=r"^[0-9.]+:[0-9.]+$", description="LO:HI, pass-rate band kept"
    )
    temperature: float = Field(1.0, ge=0.0, le=10.0, description="sampling temperature")
    max_tokens: int | None = Field(None, ge=1, description="completion tokens per turn")
    success_threshold: float = Field(0.5, description="episode return counted as a pass")
    timeout_s: float = Field(600.0, gt=0.0, description="limit on the whole evaluation")
    data: DataConfig = section(DataConfig)

    @property
    def band(self) -> tuple[float, float]:
        lo, hi = (float(x) for x in self.keep.split(":"))
        if not 0.0 <= lo <= hi <= 1.0:
            raise ConfigError(f"--keep {self.keep}: need 0 <= LO <= HI <= 1")
        return lo, hi


def kept_rows(
    rows: Sequence[Any],
    groups: dict[int, Any],
    band: tuple[float, float],
    threshold: float,
    prompt_spec: str | None = None,
) -> tuple[list[dict[str, Any]], int]:
    """The rows whose pass rate lies in `band` (each with its rate: ``meta.pass_rate`` on a
    task line, a ``pass_rate`` column on a row of a dataset of prompts, so the file reads
    back with the same flags), and how many rows the infrastructure spoiled or never
    answered (left out, not scored)."""
    kept: list[dict[str, Any]] = []
    unscored = 0
    for index, row in enumerate(rows):
        group = groups.get(index)
        if group is None or group.infra_failed:
            unscored += 1
            continue
        passed = [sum(t.reward for t in e.turns) >= threshold for e in group.trajectories]
        rate = sum(passed) / len(passed)
        if band[0] <= rate <= band[1]:
            kept.append(_kept_line(row, rate, prompt_spec))
    return kept, unscored


def _kept_line(row: Any, rate: float, prompt_spec: str | None) -> dict[str, Any]:
    if row.row is not None and row.env_spec == prompt_spec:  # a row of a dataset of prompts
        return {**row.row, "pass_rate": rate}
    line: dict[str, Any] = {"env_spec": row.env_spec, "difficulty": row.difficulty}
    if row.max_turns is not None:
        line["max_turns"] = row.max_turns
    line["meta"] = {**(row.meta or {}), "pass_rate": rate}
    if row.row is not None:
        line["row"] = row.row
    return line


async def _filter(ctx: RoleContext[FilterConfig]) -> int:
    from broker.connection import RedisSettings, connect
    from broker.keys import RunKeys
    from learner.evaluation import Evaluator
    from learner.tasks import load_dataset

    cfg = ctx.config
    try:
        band = cfg.band
        for name in cfg.env_modules:
            importlib.import_module(name)
        rows = load_dataset(cfg.tasks, cfg.data)
    except (ConfigError, TaskSourceError, ImportError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    spec = EvalConfig(
        eval_tasks=[f"filter={cfg.tasks}"],
        eval_samples=cfg.samples,
        eval_temperature=cfg.temperature,
        eval_max_tokens=cfg.max_tokens,
        eval_timeout_s=cfg.timeout_s,
    )
    redis = await connect(RedisSettings.from_url(cfg.redis_url))
    keys = RunKeys(cfg.run, cfg.partitions)
    evaluator = Evaluator(redis, keys, {"filter": rows}, spec, f"filter-{uuid.uuid4().hex[:8]}")
    try:
        await evaluator.start()
        current = await evaluator.issue(-1, 0)
        await evaluator.finish(current)
    finally:
        await evaluator.consumer.destroy_group()  # nothing reads this evaluation's group again
        await redis.aclose()
    by_row = {g.task.eval.row: g for g in current.groups.values()}  # type: ignore[union-attr]
    kept, unscored = kept_rows(rows, by_row, band, cfg.success_threshold, cfg.data.env_spec())
    cfg.out.write_text("".join(json.dumps(line) + "\n" for line in kept))
    print(
        f"kept {len(kept)} of {len(rows)} tasks with pass rate in [{band[0]}, {band[1]}] "
        f"({cfg.samples} samples each); {unscored} unscored (infrastructure) -> {cfg.out}"
    )
    return 3 if unscored else 0


FILTER = Role(
    name="learner filter",
    config=FilterConfig,
    main=_filter,
    description="Keep the tasks whose pass rate through the farm lies in a band.",
)


def main_filter(argv: list[str]) -> int:
    return start(FILTER, argv)
