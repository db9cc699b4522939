"""Consumer groups against a real redis-server: commit, dedup, dead letters, reclaim."""

from __future__ import annotations

import asyncio

import pytest

from broker.codec import decode, encode
from broker.connection import RedisSettings, connect
from broker.consumer import Consumer, ConsumerConfig, ConsumerSettings
from broker.keys import LEARNER_GROUP, WORKERS_GROUP, RunKeys
from broker.messages import DeadLetter, TrajectoryGroup
from broker.producer import Producer
from tests.broker.helpers import make_group, make_task, task_consumer

KEYS = RunKeys("t")


@pytest.fixture
async def redis(broker_url):
    client = await connect(RedisSettings.from_url(broker_url))
    yield client
    await client.aclose()


def consumer(redis, name: str, **overrides) -> Consumer:
    return task_consumer(redis, KEYS, name, **{"block_ms": 50, **overrides})


async def test_commit_publishes_acks_and_records_seen(redis):
    producer = Producer(redis)
    await producer.publish(KEYS.tasks, [make_task("a"), make_task("b")])
    c = consumer(redis, "w1")
    await c.ensure_groups()
    got = await c.read()
    assert [d.message.task_id for d in got] == ["a", "b"]
    published = await c.commit(got[:1], publish=[(KEYS.trajectories(), make_group("a"))])
    assert published[0]
    pending = await redis.xpending(KEYS.tasks, WORKERS_GROUP)
    assert pending["pending"] == 1  # "b" still pending: not committed
    entries = await redis.xrange(KEYS.trajectories())
    assert len(entries) == 1
    assert decode(entries[0][1]).group_id == "a"


async def test_destroy_group_removes_the_group_and_its_seen_set(redis):
    await Producer(redis).publish(KEYS.tasks, [make_task("a"), make_task("b")])
    c = consumer(redis, "w1")
    await c.ensure_groups()
    [d, _] = await c.read()
    await c.commit([d])
    seen = KEYS.seen(WORKERS_GROUP, KEYS.partition_of(KEYS.tasks))
    assert await redis.exists(seen)
    await c.destroy_group()
    assert await redis.xinfo_groups(KEYS.tasks) == []
    assert not await redis.exists(seen)
    assert await redis.xlen(KEYS.tasks) == 2  # the entries stay: only the reader goes


async def test_commit_skips_publish_of_already_committed_task(redis):
    await Producer(redis).publish(KEYS.tasks, [make_task("a")])
    c = consumer(redis, "w1")
    await c.ensure_groups()
    [d] = await c.read()
    await c.commit([d], publish=[(KEYS.trajectories(), make_group("a"))])
    # a slow second worker finishing the same task must not publish a second group
    again = await c.commit([d], publish=[(KEYS.trajectories(), make_group("a"))])
    assert again == [""]
    assert await redis.xlen(KEYS.trajectories()) == 1


async def test_duplicate_entries_are_dropped_by_message_id(redis):
    producer = Producer(redis)
    await producer.publish(KEYS.tasks, [make_task("dup")])
    c = consumer(redis, "w1")
    await c.ensure_groups()
    await c.commit(await c.read())
    await producer.publish(KEYS.tasks, [make_task("dup"), make_task("new")])
    got = await c.read()
    assert [d.message.task_id for d in got] == ["new"]
    assert (await redis.xpending(KEYS.tasks, WORKERS_GROUP))["pending"] == 1


async def test_garbage_and_unknown_version_are_dead_lettered(redis):
    good = encode(make_task("ok"))
    future = dict(good)
    future[b"v"] = b"99"
    await redis.xadd(KEYS.tasks, {b"junk": b"\x00\xff"})
    await redis.xadd(KEYS.tasks, future)
    await redis.xadd(KEYS.tasks, {b"k": b"task", b"v": b"1", b"b": b"\xc1not msgpack"})
    await redis.xadd(KEYS.tasks, good)
    c = consumer(redis, "w1")
    await c.ensure_groups()
    got = await c.read()
    assert [d.message.task_id for d in got] == ["ok"]
    letters = [decode(f) for _, f in await redis.xrange(KEYS.deadletter)]
    assert all(isinstance(x, DeadLetter) for x in letters)
    reasons = [x.reason for x in letters]
    assert len(reasons) == 3
    assert "envelope" in reasons[0]
    assert "unsupported schema version 99" in reasons[1]
    assert "undecodable" in reasons[2]
    assert letters[1].fields == future  # raw fields kept for requeue
    assert (await redis.xpending(KEYS.tasks, WORKERS_GROUP))["pending"] == 1  # only "ok"


async def test_wrong_kind_on_a_stream_is_dead_lettered(redis):
    await Producer(redis).publish(KEYS.tasks, [make_group("g")])
    c = consumer(redis, "w1")
    await c.ensure_groups()
    assert await c.read() == []
    [(_, fields)] = await redis.xrange(KEYS.deadletter)
    assert "expected 'task'" in decode(fields).reason


async def test_idle_entries_are_reclaimed_and_over_delivered_ones_dead_lettered(redis):
    await Producer(redis).publish(KEYS.tasks, [make_task("x")])
    dead = consumer(redis, "dead")
    await dead.ensure_groups()
    assert len(await dead.read()) == 1  # taken, never committed
    survivor = consumer(
        redis,
        "alive",
        settings=ConsumerSettings(reclaim_idle_s=0.01, max_deliveries=3),
        reclaim_interval_s=0,
    )
    await asyncio.sleep(0.05)
    got = await survivor.read()
    assert [(d.message.task_id, d.deliveries) for d in got] == [("x", 2)]
    await asyncio.sleep(0.05)
    again = await survivor.read()  # reclaimed from itself: third delivery
    assert [d.deliveries for d in again] == [3]
    await asyncio.sleep(0.05)
    assert await survivor.read() == []  # fourth delivery exceeds max: dead letter
    [(_, fields)] = await redis.xrange(KEYS.deadletter)
    assert "delivered 4 times" in decode(fields).reason


async def test_restarted_consumer_gets_its_own_pending_first(redis):
    await Producer(redis).publish(KEYS.trajectories(), [make_group("g1"), make_group("g2")])
    cfg = ConsumerConfig(group=LEARNER_GROUP, consumer="learner-0", block_ms=50)
    first = Consumer(redis, KEYS, [KEYS.trajectories()], cfg, expect=TrajectoryGroup)
    await first.ensure_groups()
    assert len(await first.read(count=1)) == 1
    restarted = Consumer(redis, KEYS, [KEYS.trajectories()], cfg, expect=TrajectoryGroup)
    [again] = await restarted.read()
    assert again.message.group_id == "g1"
    [nxt] = await restarted.read()
    assert nxt.message.group_id == "g2"


async def test_keep_alive_stops_a_live_consumers_entry_being_reclaimed(redis):
    await Producer(redis).publish(KEYS.tasks, [make_task("busy")])
    owner = consumer(redis, "owner")
    await owner.ensure_groups()
    [d] = await owner.read()
    other = consumer(
        redis, "other", settings=ConsumerSettings(reclaim_idle_s=0.15), reclaim_interval_s=0
    )
    for _ in range(4):
        await asyncio.sleep(0.1)
        await owner.keep_alive(KEYS.tasks, [d.entry_id])
        assert await other.read() == []
    await asyncio.sleep(0.2)  # the owner stops renewing: now it counts as dead
    [taken] = await other.read()
    assert taken.message.task_id == "busy" and taken.deliveries == 2
