"""Where live batches come from: the trajectories stream(s), with task feeding.

`LiveSource` reads `TrajectoryGroup`s through `broker.consumer.Consumer` (group
``LEARNER_GROUP``) until it holds ``groups_per_batch`` complete groups, issuing
tasks through the `TaskFeeder` while it waits. Its invariant: an entry is acked
(`commit_trained`) only after a checkpoint that includes its effect is durable,
so after a SIGKILL the resumed learner (same consumer name) gets its own
pending entries back first and trains each group exactly once relative to the
weights it resumed from. Groups that decode but are unusable (token ids outside
the vocabulary, non-finite logprobs, wrong group size) are dead-lettered here.
Tasks the workers dead-letter give their admission slot back here (`DeadLetterWatch`).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import redis.asyncio as aioredis

from broker.consumer import Consumer, ConsumerConfig, ConsumerSettings, Delivery
from broker.errors import BudgetError, RedisUnavailable
from broker.keys import LEARNER_GROUP, RunKeys
from broker.messages import TrajectoryGroup
from broker.outage import Backoff, retry_while_unavailable
from learner.health import DeadLetterWatch
from learner.sampling import DynamicSampling
from learner.tasks import TaskFeeder

log = logging.getLogger(__name__)


def problem_with(group: TrajectoryGroup, vocab_size: int) -> str | None:
    """Why a decoded group cannot be trained, or None when it can."""
    if len(group.trajectories) != group.task.group_size:
        return f"{len(group.trajectories)} trajectories for group_size {group.task.group_size}"
    for trajectory in group.trajectories:
        for turn in trajectory.turns:
            for ids in (turn.prompt_ids, turn.completion_ids):
                if len(ids) and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
                    return f"token id outside the vocabulary (size {vocab_size})"
            if len(turn.logprobs) and not bool(np.all(np.isfinite(turn.logprobs))):
                return "non-finite behaviour logprob"
            if not math.isfinite(turn.reward):
                return "non-finite reward"
    return None


@dataclass(frozen=True)
class Batch:
    """One batch of complete groups and the time spent waiting for it."""

    deliveries: list[Delivery]
    wait_s: float

    @property
    def groups(self) -> list[TrajectoryGroup]:
        return [d.message for d in self.deliveries]  # type: ignore[misc]


class LiveSource:
    """Consumes the trajectories stream(s), feeds tasks, acks after checkpoints."""

    def __init__(
        self,
        redis: aioredis.Redis,
        keys: RunKeys,
        consumer_config: ConsumerConfig,
        feeder: TaskFeeder | None,
        vocab_size: int,
        *,
        already_trained: set[str] | None = None,
        sampling: DynamicSampling | None = None,
        dead_letters: DeadLetterWatch | None = None,
    ) -> None:
        self.redis = redis
        self.keys = keys
        self.consumer = Consumer(
            redis, keys, keys.all_trajectories, consumer_config, expect=TrajectoryGroup
        )
        self.feeder = feeder
        self.sampling = sampling  # None: every group counts toward a batch
        self.vocab_size = vocab_size
        # Group ids the resumed checkpoint already holds: a crash between writing a
        # checkpoint and acking its entries redelivers them, and they must not train twice.
        self.already_trained = set(already_trained or ())
        self.buffer: list[Delivery] = []
        self.unscreened: list[Delivery] = []  # read, not yet screened (kept across an outage)
        self.training = 0  # groups of the batch being trained (popped, not yet a new version)
        self.released: set[tuple[str, str]] = set()  # entries whose budget slot this process freed
        self.issued = 0
        self.dead_letters = dead_letters  # tasks the workers gave up on: slots back, streak

    @staticmethod
    def consumer_config(name: str, settings: ConsumerSettings) -> ConsumerConfig:
        return ConsumerConfig(LEARNER_GROUP, name, settings=settings, block_ms=500)

    async def start(self) -> None:
        await self.consumer.ensure_groups()

    async def top_up(self, version: int, step: int) -> None:
        # The batch in training counts as buffered until its step is done: a task issued
        # now samples from the current version, so it must fit in the bound measured
        # from the last *finished* step, else staleness could reach max_staleness + 1.
        if self.feeder is not None:
            reserve = len(self.buffer) + self.training
            self.issued += len(await self.feeder.top_up(reserve, version, step))

    async def next_batch(
        self, size: int, version: int, step: int, stop: asyncio.Event
    ) -> Batch | None:
        """Block until `size` groups are buffered (None if `stop` is set first).

        Called once the previous batch's step (and push) is done.
        """
        started = time.perf_counter()
        self.training = 0
        backoff = Backoff("reading groups")
        while (take := self._batch_length(size)) is None:
            if stop.is_set():
                return None
            try:
                await self._fill(size, version, step)
            except RedisUnavailable as exc:  # an outage: what was read stays in memory
                await backoff.wait(exc, stop)
                continue
            backoff.reset()
        wait_s = time.perf_counter() - started
        batch, self.buffer = self.buffer[:take], self.buffer[take:]
        self.training = len(batch)
        if self.sampling is not None:
            self.sampling.observe([d.message for d in batch])  # type: ignore[misc]
            if self.feeder is not None:
                limit = self.sampling.admission_limit()
                await retry_while_unavailable(
                    lambda: self.feeder.set_limit(limit),  # type: ignore[union-attr]
                    "moving the admission limit",
                    stop,
                )
        await retry_while_unavailable(lambda: self.top_up(version, step), "issuing tasks", stop)
        return Batch(batch, wait_s)

    async def _watch_dead_letters(self) -> None:
        """A dead-lettered task never yields a group: free its slot here (else the budget
        leaks), and fail the run when nothing but dead letters comes back."""
        if self.dead_letters is None:
            return
        freed = await self.dead_letters.poll()
        if freed and self.feeder is not None:
            try:
                await self.feeder.release(freed)
            except BudgetError as exc:  # e.g. a requeued dead letter whose group came back
                log.warning("admission release for dead-lettered tasks: %s", exc)
        self.dead_letters.check()

    def _batch_length(self, size: int) -> int | None:
        """How many buffered groups make the next batch, or None while too few."""
        if self.sampling is not None:
            return self.sampling.batch_length([d.message for d in self.buffer], size)  # type: ignore[misc]
        return size if len(self.buffer) >= size else None

    async def _fill(self, size: int, version: int, step: int) -> None:
        await self._watch_dead_letters()
        await self.top_up(version, step)
        wanted = size if self.sampling is not None else size - len(self.buffer)
        got = await self.consumer.read(count=wanted)
        # An entry read again while still held here (a read lost in a failover, or its
        # own idle entry reclaimed) must not be buffered, and trained, twice.
        held = {(d.stream, d.entry_id) for d in (*self.buffer, *self.unscreened)}
        got = [d for d in got if (d.stream, d.entry_id) not in held]
        if got and self.dead_letters is not None:
            self.dead_letters.groups_arrived()
        # A slot is freed once per entry and process: count_in_flight() at start-up
        # counted this learner's pending entries too, so redelivered ones free theirs.
        fresh = [(d.stream, d.entry_id) for d in got if (d.stream, d.entry_id) not in self.released]
        self.unscreened += got
        if self.feeder is not None and fresh:
            try:
                await self.feeder.release(len(fresh))
            except BudgetError as exc:  # groups nobody issued through the budget
                log.warning("admission release: %s", exc)
        self.released.update(fresh)
        await self._screen()

    async def _screen(self) -> None:
        """Move what was read into the buffer, acking groups the checkpoint already holds and
        dead-lettering bad ones in one commit; nothing leaves `unscreened` before that commit."""
        keep: list[Delivery] = []
        done: list[Delivery] = []
        dead: list[tuple[Delivery, str]] = []
        for d in self.unscreened:
            assert isinstance(d.message, TrajectoryGroup)
            if d.message.group_id in self.already_trained:
                log.info("group %s is in the checkpoint already; acking it", d.message.group_id)
                done.append(d)
            elif (reason := problem_with(d.message, self.vocab_size)) is not None:
                dead.append((d, f"group {d.message.group_id}: {reason}"))
            else:
                keep.append(d)
        if done or dead:
            await self.consumer.commit(done, dead_letters=dead)
        for d in done:
            self.already_trained.discard(d.message.group_id)  # type: ignore[union-attr]
        settled = [*done, *(d for d, _ in dead)]
        self.released.difference_update((d.stream, d.entry_id) for d in settled)
        self.buffer += keep
        self.unscreened = []

    async def commit_trained(
        self, deliveries: Sequence[Delivery], stop: asyncio.Event | None = None
    ) -> None:
        """Ack entries whose effect a durable checkpoint now holds, riding out an outage
        (until `stop` is set: then RedisUnavailable leaves them pending)."""
        if deliveries:
            await retry_while_unavailable(
                lambda: self.consumer.commit(deliveries), "acking trained groups", stop
            )
            self.released.difference_update((d.stream, d.entry_id) for d in deliveries)
