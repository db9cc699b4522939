"""Task feeding: the curriculum sampler, the horizon, the budget.

The dataset (`learner.datasets`: JSONL task lines ``{"env_spec": "toy@{...}",
"difficulty": 0, "max_turns": null, "meta": {}, "row": {...}}``, or a dataset of prompts
in JSONL, Parquet or a `datasets` directory) is read lazily: the sampler holds its row
count and difficulties, and reads a row only when it draws it. `TaskSampler` draws rows
with a seeded generator; with a curriculum
it draws only rows of the current difficulty level and moves the level up when
the success rate over the last `window` episodes reaches `promote_above`, down
when it falls to `demote_below`. Its state round-trips through JSON so that a
checkpoint can hold it.

`TaskFeeder.top_up` is the only place tasks are issued: it takes slots from
the broker's `AdmissionBudget` (passing the learner's buffered groups as the
reserve), so tasks in flight plus groups buffered never exceed the limit
(``LearnerConfig.admission_limit``, moved by dynamic sampling through
`TaskFeeder.set_limit`) however many workers run. The
horizon schedule's value is stamped on each task it issues (`Task.max_turns`): the
task is the one place a worker reads it from.
"""

from __future__ import annotations

import uuid
from collections import deque
from collections.abc import Sequence
from typing import Any

import numpy as np
import redis.asyncio as aioredis

from broker.admission import AdmissionBudget
from broker.backlog import group_backlog, unfinished_entries
from broker.codec import decode
from broker.errors import DecodeError
from broker.keys import RunKeys
from broker.messages import Task, TrajectoryGroup
from broker.producer import Producer
from learner.config import CurriculumRules, HorizonSchedule
from learner.datasets import TaskRow, load_dataset
from learner.metrics import TASKS_ISSUED

__all__ = ["TaskFeeder", "TaskRow", "TaskSampler", "count_in_flight", "load_dataset"]


class TaskSampler:
    """Seeded draws from the dataset, optionally following a difficulty curriculum, and
    optionally deferring rows whose recent groups were all solved or all failed
    (`difficulty_filter`: such a group carries no signal for a group baseline)."""

    def __init__(self, rows: Sequence[TaskRow], seed: int, rules: CurriculumRules) -> None:
        self.rows = rows
        self.rules = rules
        self.difficulties = _difficulties(rows)  # None: every row at 0
        found = [0] if self.difficulties is None else np.unique(self.difficulties)
        self.levels = sorted(int(d) for d in found)
        self._by_level: dict[int, np.ndarray] = {}
        self.level_index = 0
        self.recent: deque[bool] = deque(maxlen=rules.curriculum_window)
        self.rng = np.random.default_rng(seed)
        self.streaks: dict[int, int] = {}  # row -> groups in a row all solved or all failed
        self.deferred: dict[int, int] = {}  # row -> step until which it is not drawn
        self.step = 0

    @property
    def level(self) -> int:
        return self.levels[self.level_index]

    def draw(self) -> tuple[TaskRow, int]:
        """A row and a task seed."""
        _, row, seed = self.draw_row()
        return row, seed

    def draw_row(self) -> tuple[int, TaskRow, int]:
        """A row's index, the row and a task seed."""
        index = self.draw_index()
        return index, self.rows[index], int(self.rng.integers(2**31 - 1))

    def draw_index(self) -> int:
        """The index of the next row drawn (a deferred row only when every row is)."""
        pool = self._pool()
        held = [i for i, until in self.deferred.items() if until > self.step]
        if held:  # few: only rows whose recent groups carried no signal
            everything = np.arange(len(self.rows)) if pool is None else pool
            live = everything[~np.isin(everything, held)]
            if len(live):
                return int(live[int(self.rng.integers(len(live)))])
        if pool is None:
            return int(self.rng.integers(len(self.rows)))
        return int(pool[int(self.rng.integers(len(pool)))])

    def _pool(self) -> np.ndarray | None:
        """The row indices drawn from now (None: every row, without listing them)."""
        if not self.rules.curriculum or self.difficulties is None or len(self.levels) == 1:
            return None
        level = self.level
        if level not in self._by_level:
            self._by_level[level] = np.flatnonzero(self.difficulties == level)
        return self._by_level[level]

    def observe_groups(self, rows_returns: list[tuple[int, list[float]]], step: int) -> None:
        """Per row (its index, its group's episode returns): defer a row once
        `difficulty_filter` of its groups in a row were all solved or all failed."""
        self.step = step
        limit = self.rules.difficulty_filter
        if not limit:
            return
        for index, returns in rows_returns:
            solved = {r >= self.rules.success_threshold for r in returns}
            if len(solved) == 1:
                self.streaks[index] = self.streaks.get(index, 0) + 1
            else:
                self.streaks.pop(index, None)
            if self.streaks.get(index, 0) >= limit:
                self.deferred[index] = step + self.rules.difficulty_defer_steps
                self.streaks.pop(index, None)

    def observe(self, episode_returns: list[float]) -> None:
        """Feed finished episodes; move the level when the window says so."""
        if not self.rules.curriculum:
            return
        for r in episode_returns:
            self.recent.append(r >= self.rules.success_threshold)
        if len(self.recent) < self.rules.curriculum_window:
            return
        rate = sum(self.recent) / len(self.recent)
        if rate >= self.rules.promote_above and self.level_index < len(self.levels) - 1:
            self.level_index += 1
            self.recent.clear()
        elif rate <= self.rules.demote_below and self.level_index > 0:
            self.level_index -= 1
            self.recent.clear()

    def state(self) -> dict[str, Any]:
        return {
            "level_index": self.level_index,
            "recent": list(self.recent),
            "rng": self.rng.bit_generator.state,
            "streaks": [[i, n] for i, n in self.streaks.items()],
            "deferred": [[i, s] for i, s in self.deferred.items()],
        }

    def restore(self, state: dict[str, Any]) -> None:
        if not state:
            return
        self.level_index = min(int(state["level_index"]), len(self.levels) - 1)
        self.recent.clear()
        self.recent.extend(bool(x) for x in state["recent"])
        self.rng.bit_generator.state = state["rng"]
        self.streaks = {int(i): int(n) for i, n in state.get("streaks", [])}
        self.deferred = {int(i): int(s) for i, s in state.get("deferred", [])}


def _difficulties(rows: Sequence[TaskRow]) -> np.ndarray | None:
    """Each row's difficulty (None: all 0): a lazy dataset's own array, else read off rows."""
    if hasattr(rows, "difficulties"):
        return rows.difficulties  # type: ignore[no-any-return]
    found = np.asarray([r.difficulty for r in rows], dtype=np.int32)
    return found if found.any() else None


def row_returns(groups: list[TrajectoryGroup]) -> list[tuple[int, list[float]]]:
    """(dataset row, episode returns) of each group whose task names its row, leaving out
    groups the infrastructure spoiled (they say nothing about the task's difficulty)."""
    out = []
    for group in groups:
        row = group.task.meta.get("row")
        if isinstance(row, int) and not group.infra_failed:
            returns = [sum(turn.reward for turn in t.turns) for t in group.trajectories]
            out.append((row, returns))
    return out


class TaskFeeder:
    """Issues tasks inside the admission budget."""

    def __init__(
        self,
        redis: aioredis.Redis,
        keys: RunKeys,
        sampler: TaskSampler,
        horizon: HorizonSchedule,
        group_size: int,
        *,
        limit: int,
        producer: Producer | None = None,
        budget: AdmissionBudget | None = None,
    ) -> None:
        self.redis = redis
        self.keys = keys
        self.sampler = sampler
        self.horizon = horizon
        self.group_size = group_size
        self.limit = limit
        self.budget = budget or AdmissionBudget(redis, keys)  # the learner's, like the
        self.producer = producer or Producer(redis)  # producer, waits for replicas
        self._next_partition = 0  # where the next task is published

    async def start(self, in_flight: int) -> None:
        """Set the limit and re-count what is already in flight (fresh run or resume)."""
        await self.budget.set_limit(self.limit)
        await self.budget.reset()
        if in_flight:
            await self.budget.try_acquire(in_flight)

    async def set_limit(self, limit: int) -> None:
        """Move the admission limit (dynamic sampling over-issues by the filter rate)."""
        if limit != self.limit:
            self.limit = limit
            await self.budget.set_limit(limit)

    async def top_up(self, buffered: int, version: int, step: int) -> list[Task]:
        """Issue as many tasks as the budget allows now; return them."""
        horizon = self.horizon.at(step)
        granted = await self.budget.try_acquire(self.limit, reserve=buffered)
        tasks: list[Task] = []
        for _ in range(granted):
            index, row, seed = self.sampler.draw_row()
            meta = dict(row.meta or {})
            meta["difficulty"] = row.difficulty
            meta["row"] = index  # the difficulty filter's key
            tasks.append(
                Task(
                    task_id=f"{self.keys.run}-{uuid.uuid4().hex[:16]}",
                    env_spec=row.env_spec,
                    group_size=self.group_size,
                    seed=seed,
                    policy_version=version,
                    max_turns=row.max_turns if horizon is None else horizon,
                    meta=meta,
                    row=row.row,
                )
            )
        by_partition: dict[int, list[Task]] = {}
        for task in tasks:  # round robin over the partitions' tasks streams (cluster slots)
            by_partition.setdefault(self._next_partition, []).append(task)
            self._next_partition = (self._next_partition + 1) % self.keys.partitions
        for partition, part in sorted(by_partition.items()):
            await self.producer.publish(self.keys.task_stream(partition), part)
        TASKS_ISSUED.inc(len(tasks))
        return tasks

    async def release(self, n: int) -> None:
        if n:
            await self.budget.release(n)


async def count_in_flight(
    redis: aioredis.Redis, keys: RunKeys, workers_group: str, learner_group: str
) -> int:
    """Tasks issued whose groups the learner has not consumed yet, from the streams.

    Workers publish a group and ack its task in one transaction, so every issued
    task whose group the learner has not acked is exactly one of: undelivered or
    pending on the tasks stream, or its group undelivered or pending (read, not yet
    acked) on a trajectories stream. Eval tasks (`Task.eval`) took no slot and are left
    out: the tasks streams' waiting and pending entries are read to find them. Where
    Redis cannot tell a group's lag (an entry deleted past its last delivery, or a
    failover), `broker.backlog` counts the entries past the last delivery: counting the
    whole stream instead would hold admission slots that nothing ever releases, and
    stall the run once they crowd out a batch.
    """
    total = 0
    streams = [(s, workers_group) for s in keys.all_tasks]
    streams += [(s, learner_group) for s in keys.all_trajectories]
    for stream, group in streams:
        backlog = await group_backlog(redis, stream, group)
        total += backlog.undelivered + backlog.pending
        if group == workers_group and backlog.last_delivered_id is not None:
            entries = await unfinished_entries(redis, stream, group, backlog.last_delivered_id)
            total -= _eval_tasks(entries)
    return total


def _eval_tasks(entries: list[tuple[Any, dict[bytes, bytes]]]) -> int:
    """How many of `entries` are eval tasks."""
    count = 0
    for _, fields in entries:
        try:
            task = decode(fields, expect=Task)
        except DecodeError:
            continue  # dead-lettered when read: it holds a slot like any task until then
        count += isinstance(task, Task) and task.is_eval
    return count
