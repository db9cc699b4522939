"""Failure tests with real processes and a real redis-server."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import textwrap

import pytest

from broker.admission import AdmissionBudget
from broker.backlog import group_backlog, unfinished_entries
from broker.codec import decode
from broker.connection import RedisSettings, connect
from broker.consumer import ConsumerSettings
from broker.deadletters import list_dead_letters, requeue
from broker.errors import BudgetError, RedisUnavailable
from broker.keys import WORKERS_GROUP, RunKeys
from broker.producer import Producer
from broker.status import run_state
from tests.broker.helpers import make_group, make_task, task_consumer

KEYS = RunKeys("f")

VICTIM = textwrap.dedent("""
    import asyncio, sys
    from broker.connection import RedisSettings, connect
    from broker.keys import RunKeys
    from tests.broker.helpers import make_group, task_consumer

    async def main():
        keys = RunKeys("f")
        redis = await connect(RedisSettings.from_url(sys.argv[1]))
        c = task_consumer(redis, keys, "victim")
        await c.ensure_groups()
        batch = await c.read(count=10)
        await c.commit(batch[:3], publish=[(keys.trajectories(), make_group(d.message.task_id)) for d in batch[:3]])
        print("mid-batch", len(batch), flush=True)
        await asyncio.sleep(3600)

    asyncio.run(main())
""")


@pytest.fixture
async def redis(broker_url):
    client = await connect(RedisSettings.from_url(broker_url))
    yield client
    await client.aclose()


async def test_sigkilled_consumer_entries_are_reclaimed_and_processed_once(redis, broker_url):
    await Producer(redis).publish(KEYS.tasks, [make_task(f"t{i}") for i in range(20)])
    victim = subprocess.Popen(
        [sys.executable, "-c", VICTIM, broker_url], stdout=subprocess.PIPE, text=True
    )
    try:
        assert victim.stdout.readline().startswith("mid-batch 10")
    finally:
        victim.send_signal(signal.SIGKILL)
        victim.wait(10)
        victim.stdout.close()

    async def survivor(name: str) -> None:
        c = task_consumer(
            redis,
            KEYS,
            name,
            block_ms=50,
            settings=ConsumerSettings(reclaim_idle_s=0.2),
            reclaim_interval_s=0.1,
        )
        idle_rounds = 0
        while idle_rounds < 10:
            batch = await c.read(count=3)
            idle_rounds = 0 if batch else idle_rounds + 1
            if batch:
                pubs = [(KEYS.trajectories(), make_group(d.message.task_id)) for d in batch]
                await c.commit(batch, publish=pubs)
            await asyncio.sleep(0.05)

    await asyncio.wait_for(asyncio.gather(survivor("s1"), survivor("s2")), timeout=30)
    produced = [decode(f).group_id for _, f in await redis.xrange(KEYS.trajectories())]
    assert sorted(produced) == sorted(f"t{i}" for i in range(20))  # each exactly once
    assert (await redis.xpending(KEYS.tasks, WORKERS_GROUP))["pending"] == 0


async def test_acked_entries_survive_redis_sigkill_with_aof(redis_factory):
    server = redis_factory(appendonly=True)
    redis = await connect(RedisSettings.from_url(server.url))
    await Producer(redis).publish(KEYS.tasks, [make_task(f"a{i}") for i in range(10)])
    c = task_consumer(redis, KEYS, "w")
    await c.ensure_groups()
    batch = await c.read(count=10)
    await c.commit(
        batch[:6], publish=[(KEYS.trajectories(), make_group(d.message.task_id)) for d in batch[:6]]
    )
    await redis.aclose()
    server.restart()  # SIGKILL, then start on the same AOF
    redis = await connect(RedisSettings.from_url(server.url))
    try:
        assert await redis.xlen(KEYS.trajectories()) == 6
        assert (await redis.xpending(KEYS.tasks, WORKERS_GROUP))["pending"] == 4
        again = task_consumer(redis, KEYS, "w")
        redelivered = [d.message.task_id for d in await again.read(count=10)]
        assert redelivered == [f"a{i}" for i in range(6, 10)]
    finally:
        await redis.aclose()


ACQUIRER = textwrap.dedent("""
    import asyncio, random, sys
    from broker.admission import AdmissionBudget
    from broker.connection import RedisSettings, connect
    from broker.keys import RunKeys

    async def main():
        redis = await connect(RedisSettings.from_url(sys.argv[1]))
        budget = AdmissionBudget(redis, RunKeys("f"))
        rng = random.Random(int(sys.argv[2]))
        peak = 0
        for _ in range(200):
            got = await budget.try_acquire(rng.randint(1, 3))
            if got:
                holders = await redis.incrby("holders", got)
                peak = max(peak, holders)
                await asyncio.sleep(rng.random() / 500)
                await redis.decrby("holders", got)
                await budget.release(got)
        print(peak)
        await redis.aclose()

    asyncio.run(main())
""")


async def test_admission_budget_holds_across_processes(redis, broker_url):
    budget = AdmissionBudget(redis, KEYS)
    await budget.set_limit(5)
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", ACQUIRER, broker_url, str(i)],
            stdout=subprocess.PIPE,
            text=True,
        )
        for i in range(4)
    ]
    peaks = [int(p.communicate(timeout=60)[0]) for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert max(peaks) <= 5
    assert max(peaks) >= 3  # the processes really contended
    assert await budget.in_flight() == 0


async def test_admission_reserve_and_over_release(redis):
    budget = AdmissionBudget(redis, KEYS)
    await budget.set_limit(8)
    assert await budget.try_acquire(10, reserve=3) == 5
    assert await budget.try_acquire(1) == 1
    assert await budget.release(6) == 0
    with pytest.raises(BudgetError):
        await budget.release(1)
    with pytest.raises(BudgetError):
        await budget.set_limit(0)


async def test_unreachable_redis_is_one_clear_error():
    settings = RedisSettings(url="redis://127.0.0.1:1/0", retry_budget_s=0.5)
    with pytest.raises(RedisUnavailable, match="unreachable"):
        await connect(settings)
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "broker",
            "--redis-url",
            "redis://u:secret@127.0.0.1:1/0",
            "--redis-wait",
            "0.3",
            "status",
        ],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert r.returncode == 1
    assert r.stderr.count("Traceback") == 0
    assert "error: Redis at redis://u:***@127.0.0.1:1/0 unreachable" in r.stderr
    assert "secret" not in r.stderr


async def test_status_and_backlog_reads_translate_a_lost_redis():
    """The reads `farm status` and the learner's start-up make raise the broker's
    `RedisUnavailable`, never redis-py's errors (nothing listens on port 1)."""
    lost = RedisSettings(url="redis://127.0.0.1:1/0").client()
    try:
        with pytest.raises(RedisUnavailable, match="reading the run's state failed"):
            await run_state(lost, KEYS)
        with pytest.raises(RedisUnavailable, match=f"reading group workers of {KEYS.tasks}"):
            await group_backlog(lost, KEYS.tasks, WORKERS_GROUP)
        with pytest.raises(RedisUnavailable, match="unfinished entries"):
            await unfinished_entries(lost, KEYS.tasks, WORKERS_GROUP, "0-0")
    finally:
        await lost.aclose()


async def test_dead_letters_requeue_to_source(redis):
    await redis.xadd(KEYS.tasks, {b"k": b"task", b"v": b"2", b"b": b""})
    c = task_consumer(redis, KEYS, "w", block_ms=10)
    await c.ensure_groups()
    assert await c.read() == []
    [(dl_id, letter)] = await list_dead_letters(redis, KEYS)
    assert letter.source_stream == KEYS.tasks
    assert await requeue(redis, KEYS, [dl_id]) == 1
    assert await redis.xlen(KEYS.deadletter) == 0
    [(_, fields)] = (await redis.xrange(KEYS.tasks))[-1:]
    assert fields == {b"k": b"task", b"v": b"2", b"b": b""}


async def test_status_shows_the_dead_letter_count_and_the_latest_reason(redis, broker_url):
    from broker.messages import Task

    c = task_consumer(redis, KEYS, "w", block_ms=10)
    await c.ensure_groups()
    await Producer(redis).publish(KEYS.tasks, [make_task("t-bad"), make_task("t-worse")])
    first, second = await c.read(count=2)
    assert isinstance(first.message, Task)
    await c.dead_letter(first, "task t-bad: unknown environment 'nope'")
    await c.dead_letter(second, "task t-worse: bad kwargs for 'toy': difficulty: too high")
    assert await c.read() == []  # acked with the dead letter: never delivered again
    out = subprocess.run(
        [sys.executable, "-m", "broker", "--redis-url", broker_url, "--run", KEYS.run, "status"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    at = lines.index("  dead letters 2")
    assert lines[at + 1] == (
        f"    latest: {KEYS.tasks} {second.entry_id}: task t-worse: bad kwargs for 'toy': "
        "difficulty: too high"
    )
