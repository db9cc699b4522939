"""Coalesced group commits of a worker (`workers.commits`) against a real redis-server."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis

from broker.codec import decode
from broker.connection import RedisSettings, connect
from broker.consumer import Consumer
from broker.keys import WORKERS_GROUP, RunKeys
from broker.producer import Producer
from tests.broker.helpers import make_group, make_task, task_consumer
from workers.commits import GroupCommits

KEYS = RunKeys("gc")


@pytest.fixture
async def redis(redis_server) -> AsyncIterator[aioredis.Redis]:
    client = await connect(RedisSettings.from_url(redis_server.url))
    yield client
    await client.aclose()


async def read_tasks(redis: aioredis.Redis, n: int, prefix: str = "g") -> tuple[Consumer, list]:
    await Producer(redis).publish(KEYS.tasks, [make_task(f"{prefix}{i}") for i in range(n)])
    consumer = task_consumer(redis, KEYS, "w", block_ms=50)
    await consumer.ensure_groups()
    return consumer, await consumer.read(count=n)


async def script_calls(redis: aioredis.Redis) -> int:
    row = (await redis.info("commandstats")).get("cmdstat_evalsha", {})
    return int(row.get("calls", 0)) - int(row.get("failed_calls", 0))


async def pending(redis: aioredis.Redis) -> int:
    return (await redis.xpending(KEYS.tasks, WORKERS_GROUP))["pending"]


async def test_groups_finishing_together_share_one_commit(redis):
    consumer, got = await read_tasks(redis, 20)
    commits = GroupCommits(consumer, patience_s=5)
    runner = asyncio.create_task(commits.run(), name="group-commits")
    try:
        before = await script_calls(redis)
        results = await asyncio.gather(
            *(commits.commit(d, KEYS.trajectories(), make_group(d.message.task_id)) for d in got)
        )
        assert results == [True] * 20
        assert await script_calls(redis) - before == 1
        _, [lone] = await read_tasks(redis, 1, prefix="solo")  # a lone group goes out alone
        assert await commits.commit(lone, KEYS.trajectories(), make_group("solo0")) is True
        assert await script_calls(redis) - before == 2
    finally:
        runner.cancel()
    published = [decode(f).group_id for _, f in await redis.xrange(KEYS.trajectories())]
    assert sorted(published) == sorted([*(f"g{i}" for i in range(20)), "solo0"])
    assert await pending(redis) == 0


async def test_a_refused_group_fails_alone_and_stays_pending(redis):
    consumer, got = await read_tasks(redis, 3)
    not_a_stream = f"{KEYS.prefix}:not-a-stream"
    await redis.set(not_a_stream, "x")
    commits = GroupCommits(consumer, patience_s=5)
    runner = asyncio.create_task(commits.run(), name="group-commits")
    streams = [KEYS.trajectories(), not_a_stream, KEYS.trajectories()]
    try:
        results = await asyncio.gather(
            *(
                commits.commit(d, s, make_group(d.message.task_id))
                for d, s in zip(got, streams, strict=True)
            )
        )
    finally:
        runner.cancel()
    assert results == [True, False, True]
    published = [decode(f).group_id for _, f in await redis.xrange(KEYS.trajectories())]
    assert published == ["g0", "g2"]
    rows = await redis.xpending_range(KEYS.tasks, WORKERS_GROUP, "-", "+", 10)
    assert [r["message_id"].decode() for r in rows] == [got[1].entry_id]


async def test_a_group_cancelled_before_its_commit_is_not_acked(redis):
    consumer, got = await read_tasks(redis, 2)
    commits = GroupCommits(consumer, patience_s=5)
    waiting = [
        asyncio.create_task(commits.commit(d, KEYS.trajectories(), make_group(d.message.task_id)))
        for d in got
    ]
    await asyncio.sleep(0)  # both queued; the committer is not running yet
    waiting[0].cancel()
    runner = asyncio.create_task(commits.run(), name="group-commits")
    try:
        assert await waiting[1] is True
        with pytest.raises(asyncio.CancelledError):
            await waiting[0]
    finally:
        runner.cancel()
    published = [decode(f).group_id for _, f in await redis.xrange(KEYS.trajectories())]
    assert published == ["g1"]
    assert await pending(redis) == 1


async def test_an_outage_past_the_deadline_leaves_the_group_pending(redis_factory):
    server = redis_factory(appendonly=True)  # fsync always: what was acked survives the kill
    client = await connect(RedisSettings.from_url(server.url, socket_timeout_s=1.0))
    try:
        consumer, got = await read_tasks(client, 1)
        commits = GroupCommits(consumer, patience_s=0.5)
        runner = asyncio.create_task(commits.run(), name="group-commits")
        server.kill()
        try:
            pending_commit = commits.commit(got[0], KEYS.trajectories(), make_group("g0"))
            assert await asyncio.wait_for(pending_commit, 10) is False
        finally:
            runner.cancel()
    finally:
        await client.aclose()
    server.start()
    client = await connect(RedisSettings.from_url(server.url))
    try:
        assert await pending(client) == 1  # left for reclaim, not lost
        assert await client.xlen(KEYS.trajectories()) == 0
    finally:
        await client.aclose()
