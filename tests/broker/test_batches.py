"""Batched reads and commits keep the per-entry guarantees (real redis-server).

Redis counts the commands a script runs in INFO commandstats, so the tests can see
that a batch really goes out as one script call with one XACK and one ZADD.
"""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import textwrap

import pytest

from broker.archive import id_key
from broker.codec import decode, encode
from broker.consumer import Consumer
from broker.errors import RedisCommandFailed
from broker.keys import WORKERS_GROUP, RunKeys
from broker.messages import DeadLetter
from broker.producer import Producer
from tests.broker.helpers import make_group, make_task, task_consumer

KEYS = RunKeys("bt")


def consumer(redis, name: str = "w1", **overrides) -> Consumer:
    return task_consumer(redis, KEYS, name, **{"block_ms": 50, **overrides})


async def calls(redis) -> dict[str, int]:
    """Commands served successfully so far, by name (those scripts ran included; not the
    EVALSHA that a fresh server refuses with NOSCRIPT before redis-py loads the script)."""
    stats = await redis.info("commandstats")
    return {
        name.removeprefix("cmdstat_"): int(row["calls"])
        - int(row.get("failed_calls", 0))
        - int(row.get("rejected_calls", 0))
        for name, row in stats.items()
    }


async def since(redis, before: dict[str, int], *names: str) -> dict[str, int]:
    after = await calls(redis)
    return {n: after.get(n, 0) - before.get(n, 0) for n in names}


async def read_fresh(redis, prefix: str, n: int) -> tuple[Consumer, list]:
    """`n` new tasks (`prefix0`...), published and read by one consumer."""
    await Producer(redis).publish(KEYS.tasks, [make_task(f"{prefix}{i}") for i in range(n)])
    c = consumer(redis)
    await c.ensure_groups()
    return c, await c.read(count=n)


async def pending_ids(redis) -> list[str]:
    rows = await redis.xpending_range(KEYS.tasks, WORKERS_GROUP, "-", "+", 1000)
    return [r["message_id"].decode() for r in rows]


async def seen(redis, *mids: str) -> list[bool]:
    scores = await redis.zmscore(KEYS.seen(WORKERS_GROUP), list(mids))
    return [s is not None for s in scores]


async def test_one_malformed_entry_is_dead_lettered_alone_and_the_batch_commits(redis):
    producer = Producer(redis)
    await producer.publish(KEYS.tasks, [make_task(f"t{i}") for i in range(3)])
    bad_id = (await redis.xadd(KEYS.tasks, {b"k": b"task", b"v": b"1", b"b": b"\xc1"})).decode()
    await producer.publish(KEYS.tasks, [make_task(f"t{i}") for i in range(3, 6)])
    c = consumer(redis)
    await c.ensure_groups()
    before = await calls(redis)
    got = await c.read(count=10)
    assert [d.message.task_id for d in got] == [f"t{i}" for i in range(6)]
    # the bad entry went out with its own ack, in one settling script call during the read
    assert await since(redis, before, "evalsha", "xack") == {"evalsha": 1, "xack": 1}
    [(_, fields)] = await redis.xrange(KEYS.deadletter)
    letter = decode(fields)
    assert isinstance(letter, DeadLetter) and letter.entry_id == bad_id
    assert "undecodable" in letter.reason
    assert bad_id not in await pending_ids(redis) and len(await pending_ids(redis)) == 6

    before = await calls(redis)
    pubs = [(KEYS.trajectories(), make_group(d.message.task_id)) for d in got]
    published = await c.commit(got, publish=pubs)
    assert all(published) and len(published) == 6
    assert await since(redis, before, "evalsha", "xack", "zadd") == {
        "evalsha": 1,
        "xack": 1,
        "zadd": 1,
    }
    assert await pending_ids(redis) == []
    assert await seen(redis, *(f"t{i}" for i in range(6))) == [True] * 6
    assert await redis.xlen(KEYS.trajectories()) == 6


async def test_a_duplicate_within_a_batch_is_dropped_and_the_first_stays_owed(redis):
    await Producer(redis).publish(KEYS.tasks, [make_task("a"), make_task("b"), make_task("a")])
    first_a, b, second_a = [eid.decode() for eid, _ in await redis.xrange(KEYS.tasks)]
    c = consumer(redis)
    await c.ensure_groups()
    got = await c.read(count=10)
    assert [(d.message.task_id, d.entry_id) for d in got] == [("a", first_a), ("b", b)]
    # the repeat is acked, but "a" is not recorded: its first entry's effect is still owed
    assert await pending_ids(redis) == [first_a, b]
    assert await seen(redis, "a") == [False]
    # a crash now: the restarted consumer gets both owed entries back, the repeat never
    restarted = consumer(redis)
    again = await restarted.read(count=10)
    assert [d.entry_id for d in again] == [first_a, b] and second_a not in await pending_ids(redis)
    await restarted.commit(again)
    assert await restarted.read(count=10) == []
    assert await seen(redis, "a", "b") == [True, True]


async def test_a_batch_with_already_committed_ids_drops_them_in_the_same_settle(redis):
    producer = Producer(redis)
    await producer.publish(KEYS.tasks, [make_task("x"), make_task("y")])
    c = consumer(redis)
    await c.ensure_groups()
    await c.commit(await c.read(count=10))
    await producer.publish(KEYS.tasks, [make_task("x"), make_task("z"), make_task("y")])
    await redis.xadd(KEYS.tasks, {b"junk": b"1"})
    before = await calls(redis)
    got = await c.read(count=10)
    assert [d.message.task_id for d in got] == ["z"]
    # two duplicates and one dead letter: one script call, one XACK
    assert await since(redis, before, "evalsha", "xack") == {"evalsha": 1, "xack": 1}
    assert len(await pending_ids(redis)) == 1
    assert await redis.xlen(KEYS.deadletter) == 1


async def test_a_cancelled_batch_commit_still_completes_whole(redis):
    n = 40
    c, got = await read_fresh(redis, "c", n)
    pubs = [(KEYS.trajectories(), make_group(d.message.task_id, tokens=256)) for d in got]
    task = asyncio.create_task(c.commit(got, publish=pubs))
    await asyncio.sleep(0)  # the commit has started
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    # documented: a commit runs to completion even if its caller is cancelled
    assert await pending_ids(redis) == []
    assert await redis.xlen(KEYS.trajectories()) == n
    assert await seen(redis, *(f"c{i}" for i in range(n))) == [True] * n


VICTIM = textwrap.dedent("""
    import asyncio, sys
    from broker.connection import RedisSettings, connect
    from broker.keys import RunKeys
    from tests.broker.helpers import make_group, task_consumer

    async def main():
        keys = RunKeys("bt")
        redis = await connect(RedisSettings.from_url(sys.argv[1]))
        c = task_consumer(redis, keys, "victim", block_ms=50)
        await c.ensure_groups()
        print("ready", flush=True)
        while batch := await c.read(count=int(sys.argv[2])):
            pubs = [(keys.trajectories(), make_group(d.message.task_id, tokens=512)) for d in batch]
            await c.commit(batch, publish=pubs)

    asyncio.run(main())
""")


async def test_sigkill_during_batch_commits_leaves_whole_batches(redis, redis_server):
    """A consumer killed while committing batches: each batch is all done or not at all,
    and every task is acked exactly when its group is published and its id recorded."""
    batch, n = 10, 300
    await Producer(redis).publish(KEYS.tasks, [make_task(f"k{i}") for i in range(n)])
    victim = subprocess.Popen(
        [sys.executable, "-c", VICTIM, redis_server.url, str(batch)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert victim.stdout.readline().startswith("ready")
        for _ in range(500):  # kill it mid-run, a few batches in
            if await redis.xlen(KEYS.trajectories()) >= 3 * batch:
                break
            await asyncio.sleep(0.002)
    finally:
        victim.send_signal(signal.SIGKILL)
        victim.wait(10)
        victim.stdout.close()
    published = [decode(f).group_id for _, f in await redis.xrange(KEYS.trajectories())]
    assert 3 * batch <= len(published) < n, "the victim was not killed mid-run"
    assert len(published) % batch == 0  # whole batches only
    assert all(await seen(redis, *published))
    pending = set(await pending_ids(redis))
    [group] = await redis.xinfo_groups(KEYS.tasks)
    delivered = id_key(group["last-delivered-id"].decode())
    for eid, fields in await redis.xrange(KEYS.tasks):
        eid = eid.decode()
        if decode(fields).task_id in published:
            assert eid not in pending  # its group is out: acked in the same script
        else:  # not committed: pending if it was delivered, to be reclaimed
            assert (eid in pending) == (id_key(eid) <= delivered)


async def test_pending_batches_are_read_back_after_a_restart(redis):
    await Producer(redis).publish(KEYS.tasks, [make_task(f"p{i}") for i in range(25)])
    first = consumer(redis, "w1")
    await first.ensure_groups()
    batches = [await first.read(count=10) for _ in range(2)]
    await first.commit(batches[0])
    restarted = consumer(redis, "w1")
    again = [await restarted.read(count=4) for _ in range(3)]
    # its own pending entries first, in order and in batches, counted as second deliveries
    assert [[d.message.task_id for d in b] for b in again] == [
        [f"p{i}" for i in range(10, 14)],
        [f"p{i}" for i in range(14, 18)],
        [f"p{i}" for i in range(18, 20)],
    ]
    assert {d.deliveries for b in again for d in b} == {2}
    fresh = await restarted.read(count=10)
    assert [d.message.task_id for d in fresh] == [f"p{i}" for i in range(20, 25)]
    assert {d.deliveries for d in fresh} == {1}
    await restarted.commit([d for b in [*again, fresh] for d in b])
    assert await pending_ids(redis) == []


async def test_commit_of_many_entries_spans_chunks(redis):
    """More acks than one XACK chunk (500) still ack and record every entry."""
    n = 1200
    c, got = await read_fresh(redis, "m", n)
    assert len(got) == n
    before = await calls(redis)
    await c.commit(got)
    assert await since(redis, before, "evalsha", "xack", "zadd") == {
        "evalsha": 1,
        "xack": 3,
        "zadd": 3,
    }
    assert await pending_ids(redis) == []
    assert all(await seen(redis, *(f"m{i}" for i in range(n))))


async def test_dead_letters_and_acks_of_a_caller_go_in_one_commit(redis):
    c, got = await read_fresh(redis, "d", 4)
    before = await calls(redis)
    await c.commit(got[:2], dead_letters=[(d, "unusable") for d in got[2:]])
    assert await since(redis, before, "evalsha", "xack") == {"evalsha": 1, "xack": 1}
    letters = [decode(f) for _, f in await redis.xrange(KEYS.deadletter)]
    assert [(x.entry_id, x.reason) for x in letters] == [(d.entry_id, "unusable") for d in got[2:]]
    assert decode(letters[0].fields) == got[2].message  # the message kept for requeue
    assert letters[0].fields == encode(got[2].message)
    assert await pending_ids(redis) == []
    assert await seen(redis, "d0", "d1", "d2", "d3") == [True] * 4


async def test_a_batch_with_a_refused_publish_writes_nothing(redis):
    """Redis does not roll a script back: the commit checks key types before any write,
    so one refused publish fails the batch whole instead of leaving it half-published."""
    await Producer(redis).publish(KEYS.tasks, [make_task(f"r{i}") for i in range(3)])
    not_a_stream = f"{KEYS.prefix}:not-a-stream"
    await redis.set(not_a_stream, "x")
    c = consumer(redis)
    await c.ensure_groups()
    got = await c.read(count=10)
    pubs = [(KEYS.trajectories(), make_group(d.message.task_id)) for d in got[:2]]
    pubs.append((not_a_stream, make_group(got[2].message.task_id)))
    with pytest.raises(RedisCommandFailed, match="WRONGTYPE"):
        await c.commit(got, publish=pubs)
    assert await redis.xlen(KEYS.trajectories()) == 0
    assert len(await pending_ids(redis)) == 3
    assert await seen(redis, "r0", "r1", "r2") == [False] * 3
