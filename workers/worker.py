"""The worker loop: read tasks within the concurrency limit, run groups, commit, shut down.

Invariants:
- a task is acked only by the commit that publishes its complete group (one atomic
  `Consumer.commit`; groups that finish together share one, see `workers.commits`), so
  a worker that dies at any point leaves its tasks pending, to be reclaimed by another
  worker after `reclaim_idle_s`; consumers dedup on the group id;
- the worker never holds more than `concurrency` episodes' worth of tasks (plus at most one
  group): it reads only as many tasks as its free slots allow;
- a task whose spec cannot become an environment (`EnvSpecError`: unknown name, bad JSON
  or kwargs) is dead-lettered with the reason after one attempt, never published as a
  group (an undecodable task is dead-lettered by the consumer before it gets here);
- tasks still running are kept fresh (XCLAIM JUSTID) so no live worker's task is reclaimed;
- a Redis outage (at read, commit or keep-alive: `RedisUnavailable`) never ends the
  worker: it backs off and retries; a finished group's commit is retried for up to half
  of `reclaim_idle_s` (nobody else takes the task meanwhile), then the task is left
  pending; a commit retried after a lost reply publishes nothing twice;
- on stop (SIGTERM) it stops reading, lets running groups finish within `shutdown_grace_s`,
  then cancels the rest *without acking* them, and returns.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging

import envs
from broker.connection import Client
from broker.consumer import Consumer, ConsumerConfig, Delivery
from broker.errors import BrokerError, RedisUnavailable
from broker.keys import WORKERS_GROUP, RunKeys
from broker.messages import Task, TrajectoryGroup
from broker.outage import Backoff
from workers import metrics
from workers.commits import GroupCommits
from workers.config import WorkerConfig
from workers.episode import EpisodeContext
from workers.group import run_group
from workers.lag import LagMonitor

log = logging.getLogger(__name__)


class Worker:
    """One rollout worker process's task loop."""

    def __init__(self, cfg: WorkerConfig, redis: Client, ctx: EpisodeContext) -> None:
        self.cfg = cfg
        self.keys = RunKeys(cfg.run, partitions=cfg.partitions)
        self._redis = redis
        self._ctx = ctx
        self._settings = cfg.episode
        self._consumer = Consumer(
            redis,
            self.keys,
            streams=self.keys.all_tasks,  # one tasks stream per partition
            config=ConsumerConfig(WORKERS_GROUP, cfg.worker_id, settings=cfg.consumer),
            expect=Task,
        )
        # finished groups, committed in batches; nobody else takes a task within half of
        # reclaim_idle_s, so a commit may keep retrying that long through an outage
        self._commits = GroupCommits(self._consumer, cfg.consumer.reclaim_idle_s / 2)
        self._reserved = 0  # episodes of tasks read and not yet finished
        self._freed = asyncio.Event()
        # (tasks stream, entry id) -> group task
        self._running: dict[tuple[str, str], asyncio.Task[None]] = {}
        self.lag = LagMonitor()
        self.groups_published = 0
        self.tasks_dead_lettered = 0

    async def run(self, stop: asyncio.Event) -> None:
        """Take tasks until `stop` is set, then drain within the grace period."""
        backoff = Backoff("creating the tasks group")
        while True:
            try:
                await self._consumer.ensure_groups()
                break
            except RedisUnavailable as exc:
                await backoff.wait(exc, stop)
                if stop.is_set():
                    return
        async with asyncio.TaskGroup() as tg:
            aux = [
                tg.create_task(self.lag.run(), name="event-loop-lag"),
                tg.create_task(self._keep_alive(), name="task-keep-alive"),
                tg.create_task(self._commits.run(), name="group-commits"),
            ]
            try:
                async with asyncio.TaskGroup() as groups:
                    await self._read_loop(stop, groups)
                    await self._drain()
            finally:
                for task in aux:
                    task.cancel()
        log.info(
            "worker %s stopped; %d groups published", self.cfg.worker_id, self.groups_published
        )

    async def _read_loop(self, stop: asyncio.Event, groups: asyncio.TaskGroup) -> None:
        # Group sizes come with the tasks: until one is seen, read one task at a time.
        typical = self.cfg.group_size or self.cfg.concurrency
        backoff = Backoff("reading tasks")
        while not stop.is_set():
            free = self.cfg.concurrency - self._reserved
            if free <= 0:
                self._freed.clear()
                await _first(stop, self._freed)
                continue
            try:
                batch = await self._consumer.read(count=max(1, free // typical))
            except BrokerError as exc:  # RedisUnavailable: an outage; anything else: retried too
                await backoff.wait(exc, stop)
                continue
            backoff.reset()
            for delivery in batch:
                task = delivery.message
                assert isinstance(task, Task)  # the consumer was built with expect=Task
                # an eval task's k samples are its own: --group-size overrides training tasks
                n = task.group_size if task.is_eval else self.cfg.group_size or task.group_size
                typical = n
                self._reserved += n
                metrics.TASKS_IN_PROGRESS.inc()
                self._running[(delivery.stream, delivery.entry_id)] = groups.create_task(
                    self._process(delivery, n), name=f"group:{task.task_id}"
                )

    async def _process(self, delivery: Delivery, n: int) -> None:
        task = delivery.message
        assert isinstance(task, Task)
        if n != task.group_size:
            task = dataclasses.replace(task, group_size=n)
        try:
            try:
                envs.check_spec(task.env_spec)
                group = await self._run_group(task)
            except envs.EnvSpecError as exc:
                # Permanent: every attempt would fail the same way. A dead letter, never a
                # group of failed trajectories for the learner to count as a step.
                await self._consumer.dead_letter(delivery, f"task {task.task_id}: {exc}")
                self.tasks_dead_lettered += 1
                return
            if await self._commit(delivery, group):
                self.groups_published += 1
                metrics.GROUPS_PUBLISHED.inc()
        except BrokerError as exc:
            # Not acked: the task stays pending and is redone (here or elsewhere).
            log.warning("could not dead-letter %s (left pending): %s", task.task_id, exc)
        finally:
            self._reserved -= n
            self._running.pop((delivery.stream, delivery.entry_id), None)
            metrics.TASKS_IN_PROGRESS.dec()
            self._freed.set()

    async def _run_group(self, task: Task) -> TrajectoryGroup:
        """The task's group; an episode's EnvSpecError ends it and is raised as such."""
        max_turns = max(1, min(task.max_turns or self.cfg.max_turns, self.cfg.max_turns))
        try:
            return await run_group(
                self._ctx,
                self._settings,
                task,
                max_turns=max_turns,
                retries=self.cfg.episode_retries,
                worker_id=self.cfg.worker_id,
            )
        except* envs.EnvSpecError as group:
            raise group.exceptions[0] from None

    async def _commit(self, delivery: Delivery, group: TrajectoryGroup) -> bool:
        """Publish the group and ack its task, together with any other groups finishing now,
        riding out an outage; False: left pending."""
        # The task's own partition: its commit stays within one hash tag (cluster slot). An
        # eval task's group goes to the eval stream, where no learner reads to train.
        partition = self.keys.partition_of(delivery.stream)
        is_eval = group.task.is_eval
        stream = self.keys.evals(partition) if is_eval else self.keys.trajectories(partition)
        return await self._commits.commit(delivery, stream, group)

    async def _drain(self) -> None:
        """Let running groups finish within the grace period; cancel (not ack) the rest."""
        running = list(self._running.values())
        if not running:
            return
        log.info(
            "stopping: waiting up to %.0fs for %d groups", self.cfg.shutdown_grace_s, len(running)
        )
        _, pending = await asyncio.wait(running, timeout=self.cfg.shutdown_grace_s)
        for task in pending:
            task.cancel()
        if pending:
            log.info("left %d unfinished tasks pending for reclaim", len(pending))

    async def _keep_alive(self) -> None:
        """Reset the idle time of running tasks so live work is never reclaimed."""
        interval = max(0.5, self.cfg.consumer.reclaim_idle_s / 3)
        while True:
            await asyncio.sleep(interval)
            by_stream: dict[str, list[str]] = {}
            for stream, entry_id in list(self._running):
                by_stream.setdefault(stream, []).append(entry_id)
            for stream, ids in by_stream.items():
                try:
                    async with asyncio.timeout(5):
                        await self._consumer.keep_alive(stream, ids)
                except (BrokerError, TimeoutError) as exc:
                    log.warning("keep-alive of %d tasks failed: %s", len(ids), exc)


async def _first(*events: asyncio.Event) -> None:
    """Wait until any of `events` is set."""
    waiters = [asyncio.create_task(e.wait(), name="event-wait") for e in events]
    try:
        await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waiters:
            w.cancel()
