"""Worker processes joining, leaving, dying: no task is lost, none is published twice."""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest

from broker.keys import WORKERS_GROUP, RunKeys
from broker.messages import Task
from tests.workers.farm import (
    groups,
    pending_by_consumer,
    pending_ids,
    publish_tasks,
    redis_client,
    wait_groups,
    wait_until,
)

pytestmark = pytest.mark.slow


def _tasks(prefix: str, n: int, spec: str, group_size: int = 2) -> list[Task]:
    return [
        Task(f"{prefix}{i}", spec, group_size, seed=100 * i, policy_version=0) for i in range(n)
    ]


async def test_sigterm_exits_0_finishes_what_it_can_and_leaves_the_rest_pending(
    redis_server, policy_server, worker_factory
) -> None:
    keys = RunKeys("term")
    short = _tasks("short", 1, 'wk-dialogue@{"turns": 1, "step_s": 3}')
    long = _tasks("long", 1, 'wk-dialogue@{"turns": 3, "step_s": 30}')
    queued = _tasks("queued", 3, 'wk-dialogue@{"turns": 3, "step_s": 30}')
    async with redis_client(redis_server.url) as redis:
        await publish_tasks(redis, keys, [*short, *long, *queued])
        w = worker_factory(
            redis_server.url,
            "term",
            [policy_server.url],
            "--worker-id",
            "w-term",
            "--concurrency",
            "4",
            "--shutdown-grace-s",
            "6",
        )

        async def both_running() -> bool:
            return (await pending_by_consumer(redis, keys)).get("w-term") == 2

        await wait_until(both_running, 60, "the worker to take two tasks")
        for _ in range(4):  # concurrency 4 = two groups of 2: the queued tasks are not hoarded
            assert (await pending_by_consumer(redis, keys)) == {"w-term": 2}
            await asyncio.sleep(0.2)
        # The short task's 3 s step outlasts the checks above, so it ends within the grace
        # (6 s: its last 2 s with room for a loaded machine), and the long task's 30 s do not.
        assert await groups(redis, keys) == []
        assert await asyncio.to_thread(w.terminate) == 0, w.output()[-3000:]
        published = [g.group_id for g in await groups(redis, keys)]
        assert published == ["short0"]  # finished within the grace period, then acked
        assert len(await pending_ids(redis, keys)) == 1  # the long task: not acked, reclaimable
        assert (await pending_by_consumer(redis, keys)) == {"w-term": 1}
        assert await redis.xlen(keys.tasks) == 5


async def test_scale_one_to_three_then_sigkill_and_sigterm_lose_no_task(
    redis_server, policy_server, worker_factory
) -> None:
    """One worker, then three; then one is SIGKILLed mid-task and one SIGTERMed: the
    survivor redoes their tasks, and each task's group reaches the stream exactly once.

    Each wave of tasks is published when the workers that should share it are reading
    (at concurrency 4 a worker holds two tasks of 2), so no backlog is left for the
    survivor to work through alone after the faults: only the tasks it must redo."""
    keys = RunKeys("scale")
    common = ("--reclaim-idle-s", "2", "--concurrency", "4", "--shutdown-grace-s", "0.2")
    url, servers = redis_server.url, [policy_server.url]
    async with redis_client(url) as redis:
        tasks = _tasks("s", 2, 'wk-dialogue@{"turns": 2, "step_s": 1.0}')
        await publish_tasks(redis, keys, tasks)
        worker_factory(url, "scale", servers, "--worker-id", "w1", *common)
        await wait_groups(redis, keys, 1, within_s=60)
        w2, w3 = (
            worker_factory(url, "scale", servers, "--worker-id", f"w{i}", *common) for i in (2, 3)
        )

        async def three_reading() -> bool:
            return await _consumers(redis, keys) == {"w1", "w2", "w3"}

        await wait_until(three_reading, 60, "the new workers to read")
        wave = _tasks("m", 6, 'wk-dialogue@{"turns": 2, "step_s": 1.0}')
        await publish_tasks(redis, keys, wave)  # two each: what the three can hold at once
        tasks += wave

        async def all_three_working() -> bool:
            return len({g.worker_id for g in await groups(redis, keys)}) == 3

        await wait_until(all_three_working, 60, "the new workers to publish")
        # Nothing of the first waves is in flight now: what w2 holds next is late work.
        await wait_groups(redis, keys, len(tasks), within_s=60)
        late = _tasks("late", 6, 'wk-dialogue@{"turns": 2, "step_s": 1.5}')
        await publish_tasks(redis, keys, late)  # enough long work for all three at once
        tasks += late
        held: set[str] = set()

        async def w2_mid_task() -> bool:
            held.update(await _held_by(redis, keys, "w2"))
            return bool(held)

        await wait_until(w2_mid_task, 30, "w2 to be mid-task")
        w2.kill()  # SIGKILL: its tasks stay pending until reclaimed
        assert await asyncio.to_thread(w3.terminate) == 0, w3.output()[-3000:]
        await wait_groups(redis, keys, len(tasks), within_s=120)
        await asyncio.sleep(1.0)  # a duplicate publish would land now
        found = await groups(redis, keys)
        assert Counter(g.group_id for g in found) == Counter({t.task_id: 1 for t in tasks})
        redone = {g.group_id: g.worker_id for g in found if g.group_id in held}
        assert redone and set(redone.values()) <= {"w1"}  # w2 died before publishing them
        await wait_until(lambda: _no_pending(redis, keys), 10, "every task acked")


async def _consumers(redis, keys: RunKeys) -> set[str]:
    """Consumers of the tasks group: a worker joins it with its first read."""
    rows = await redis.xinfo_consumers(keys.tasks, WORKERS_GROUP)
    return {r["name"].decode() for r in rows}


async def _held_by(redis, keys: RunKeys, consumer: str) -> set[str]:
    rows = await redis.xpending_range(keys.tasks, "workers", "-", "+", 100, consumername=consumer)
    ids = {r["message_id"] for r in rows}
    entries = await redis.xrange(keys.tasks)
    from broker.codec import decode

    return {decode(f).task_id for eid, f in entries if eid in ids}


async def _no_pending(redis, keys) -> bool:
    return await pending_ids(redis, keys) == []
