"""Evaluation through the same farm: eval tasks on the tasks streams, results off the eval streams.

Invariants:
- an eval task carries an `EvalMark` (set, round, row) on the wire; workers publish its
  group to the partition's eval stream (`RunKeys.evals`), never a trajectories stream, so
  no learner can train it;
- eval tasks are published outside the admission budget (`count_in_flight` leaves them
  out at a restart too), and the staleness bound does not apply; each result records the
  weight version of every turn, and the round records the version it started at;
- each evaluator reads the eval streams through a consumer group of its own, created at
  the stream's end before its first task is published: it acks what it reads, keeps the
  groups of its round, one per task id (a redelivered task is counted once), and ignores
  other rounds' groups;
- a round ends when every task's group has come back, or at `eval_timeout_s`: the rows
  still missing are reported as ``missing_rows``, never scored as failures.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis.asyncio as aioredis

from broker.consumer import Consumer, ConsumerConfig, ConsumerSettings
from broker.errors import BrokerError, RedisUnavailable
from broker.keys import EVAL_GROUP_PREFIX, RunKeys
from broker.messages import EvalMark, Task, TrajectoryGroup
from broker.producer import Producer
from broker.status import publish_eval
from learner.config import EvalConfig
from learner.datasets import TaskRow, load_dataset
from learner.dataspec import DataConfig
from learner.evalscore import score_sets
from learner.metrics import EVAL_SCORE, EVAL_STEP

log = logging.getLogger("learner")


def load_sets(cfg: EvalConfig, data: DataConfig | None = None) -> dict[str, Sequence[TaskRow]]:
    """Every eval set's rows, each checked (TaskSourceError names the file and row), read
    lazily; `data` maps the columns of datasets of prompts, as for the training set."""
    return {name: load_dataset(path, data) for name, path in cfg.sets.items()}


@dataclass
class Round:
    """One evaluation in flight: its tasks and the groups back so far."""

    round_id: str
    step: int
    version: int
    expected: dict[str, Task]  # task id -> task
    started: float = field(default_factory=time.monotonic)
    groups: dict[str, TrajectoryGroup] = field(default_factory=dict)

    @property
    def complete(self) -> bool:
        return len(self.groups) >= len(self.expected)


@dataclass(frozen=True)
class EvalResult:
    """What one evaluation measured."""

    step: int  # learner steps done when it started
    version: int  # policy version published when it started
    seconds: float
    tasks: int
    missing_rows: int  # tasks whose group did not come back within the limit
    weight_versions: tuple[int, int]  # oldest and newest weight version among its turns
    sets: dict[str, dict[str, float]]  # set (and set/env) -> figures

    def as_json(self) -> dict[str, Any]:
        return {
            "event": "eval",
            "step": self.step,
            "version": self.version,
            "seconds": round(self.seconds, 3),
            "tasks": self.tasks,
            "missing_rows": self.missing_rows,
            "weight_versions": list(self.weight_versions),
            "sets": self.sets,
        }


class Evaluator:
    """Issues eval rounds and collects their groups (one round at a time)."""

    def __init__(
        self,
        redis: aioredis.Redis,
        keys: RunKeys,
        sets: Mapping[str, Sequence[TaskRow]],
        cfg: EvalConfig,
        name: str,
        *,
        settings: ConsumerSettings | None = None,
    ) -> None:
        self.redis = redis
        self.keys = keys
        self.sets = sets
        self.cfg = cfg
        self.producer = Producer(redis)
        config = ConsumerConfig(
            EVAL_GROUP_PREFIX + name, name, settings=settings or ConsumerSettings(), block_ms=500
        )
        self.consumer = Consumer(redis, keys, keys.all_evals, config, expect=TrajectoryGroup)
        self.current: Round | None = None
        self._partition = 0

    async def start(self) -> None:
        """Create this evaluator's group at the streams' end (an existing one keeps its place)."""
        await self.consumer.ensure_groups(start="$")

    async def issue(self, step: int, version: int) -> Round:
        """Publish one round: every row of every set, `eval_samples` samples each."""
        round_id = uuid.uuid4().hex[:12]
        tasks: list[Task] = []
        for name, rows in self.sets.items():
            for index, row in enumerate(rows):
                meta = dict(row.meta or {})
                meta["difficulty"] = row.difficulty
                tasks.append(
                    Task(
                        task_id=f"{self.keys.run}-eval-{round_id}-{name}-{index}",
                        env_spec=row.env_spec,
                        group_size=self.cfg.eval_samples,
                        seed=index,  # an env that draws its problem from the seed; one that
                        policy_version=version,  # takes it from the row gets the row
                        max_turns=row.max_turns,
                        meta=meta,
                        row=row.row,
                        eval=EvalMark(name, round_id, index),
                        temperature=self.cfg.eval_temperature,
                        max_tokens=self.cfg.eval_max_tokens,
                    )
                )
        by_partition: dict[int, list[Task]] = {}
        for task in tasks:
            by_partition.setdefault(self._partition, []).append(task)
            self._partition = (self._partition + 1) % self.keys.partitions
        for partition, part in sorted(by_partition.items()):
            await self.producer.publish(self.keys.task_stream(partition), part)
        self.current = Round(round_id, step, version, {t.task_id: t for t in tasks})
        log.info("eval round %s: %d tasks at step %d", round_id, len(tasks), step)
        return self.current

    async def collect(self, block_ms: int = 500) -> None:
        """Read what the eval streams hold now; keep this round's groups, ack everything."""
        got = await self.consumer.read(count=64, block_ms=block_ms)
        current = self.current
        for delivery in got:
            group = delivery.message
            assert isinstance(group, TrajectoryGroup)
            if current is not None and group.group_id in current.expected:
                current.groups.setdefault(group.group_id, group)
        if got:
            await self.consumer.commit(got)

    async def run_round(self, step: int, version: int) -> EvalResult:
        """Issue a round and wait for it (within `eval_timeout_s`); its result."""
        current = await self.issue(step, version)
        return await self.finish(current)

    async def finish(self, current: Round, limit_s: float | None = None) -> EvalResult:
        """Collect until `current` is complete or its time is up; its result."""
        limit = self.cfg.eval_timeout_s if limit_s is None else limit_s
        deadline = current.started + limit
        while not current.complete and time.monotonic() < deadline:
            try:
                await self.collect()
            except RedisUnavailable as exc:
                log.warning("eval round %s: %s", current.round_id, exc)
                await asyncio.sleep(1.0)
        self.current = None
        return result_of(current, self.cfg)


def result_of(current: Round, cfg: EvalConfig) -> EvalResult:
    groups = list(current.groups.values())
    versions = [turn.weight_version for g in groups for t in g.trajectories for turn in t.turns]
    span = (min(versions), max(versions)) if versions else (current.version, current.version)
    return EvalResult(
        step=current.step,
        version=current.version,
        seconds=time.monotonic() - current.started,
        tasks=len(current.expected),
        missing_rows=len(current.expected) - len(groups),
        weight_versions=span,
        sets=score_sets(groups, cfg.eval_samples, cfg.eval_success_threshold),
    )


def report(result: EvalResult, out_dir: Path | None) -> None:
    """The step log line, the Prometheus gauges and eval-STEP.json in `out_dir`."""
    line = result.as_json()
    log.info("%s", json.dumps(line))
    for key, figures in result.sets.items():
        for metric, value in figures.items():
            EVAL_SCORE.labels(set=key, metric=metric).set(value)
    EVAL_STEP.set(result.step)
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        path = out_dir / f"eval-{result.step:06d}.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(line, indent=1) + "\n")
        tmp.replace(path)


def tracker_scalars(result: EvalResult) -> dict[str, float]:
    """Chart names for the trackers: ``eval/SET[/ENV]/METRIC``."""
    return {
        f"eval/{key}/{metric}": value
        for key, figures in result.sets.items()
        for metric, value in figures.items()
    }


class EvalSchedule:
    """The learner's evaluations: before training, every `eval_interval` steps, and the one
    in flight when training ends (awaited within `eval_timeout_s`). One at a time: a round
    still running when the next is due makes that one wait for the next interval."""

    def __init__(self, evaluator: Evaluator, out_dir: Path | None, on_result: Any) -> None:
        self.evaluator = evaluator
        self.out_dir = out_dir
        self.on_result = on_result  # called with each EvalResult (the trackers)
        self.running: asyncio.Task[EvalResult] | None = None
        self.results: list[EvalResult] = []

    async def _done(self, result: EvalResult) -> None:
        report(result, self.out_dir)
        self.on_result(result)
        self.results.append(result)
        try:  # for `farm status` and the farm's console; the log and files have it already
            await publish_eval(self.evaluator.redis, self.evaluator.keys, result.as_json())
        except BrokerError as exc:
            log.warning("evaluation at step %d not published to Redis: %s", result.step, exc)

    async def before_train(self, step: int, version: int) -> None:
        await self._done(await self.evaluator.run_round(step, version))

    async def after_step(self, step: int, version: int) -> None:
        """Report a finished round; start one when it is due and none runs."""
        await self._reap()
        every = self.evaluator.cfg.eval_interval
        if every and step % every == 0 and self.running is None:
            self.running = asyncio.create_task(
                self.evaluator.run_round(step, version), name=f"eval-step-{step}"
            )

    async def _reap(self) -> None:
        if self.running is not None and self.running.done():
            task, self.running = self.running, None
            await self._done(task.result())

    async def drain(self) -> None:
        """Wait for the round in flight (its own deadline bounds the wait) and report it."""
        if self.running is not None:
            await asyncio.wait([self.running])
            await self._reap()

    async def close(self) -> None:
        if self.running is not None:
            self.running.cancel()
            await asyncio.gather(self.running, return_exceptions=True)
            self.running = None
