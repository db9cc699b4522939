"""The learner's source rides out a Redis outage: reads and acks wait, nothing is lost."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest

from broker.connection import RedisSettings, connect
from broker.consumer import ConsumerSettings
from broker.errors import RedisUnavailable
from broker.keys import LEARNER_GROUP, RunKeys
from broker.producer import Producer
from learner.source import LiveSource
from tests.conftest import RedisServer
from tests.learner.factories import make_group


async def test_next_batch_and_commit_wait_out_a_redis_restart(
    redis_factory: Callable[..., RedisServer],
) -> None:
    server = redis_factory(appendonly=True)
    keys = RunKeys("outage")
    redis = await connect(RedisSettings.from_url(server.url))
    try:
        consumer = LiveSource.consumer_config("learner", ConsumerSettings(3600.0, 10))
        source = LiveSource(redis, keys, consumer, feeder=None, vocab_size=256)
        await source.start()
        await Producer(redis).publish(keys.trajectories(), [make_group("g0"), make_group("g1")])
        stop = asyncio.Event()
        first = await source.next_batch(2, version=0, step=0, stop=stop)
        assert first is not None and [g.group_id for g in first.groups] == ["g0", "g1"]

        server.kill()  # the outage: reads fail until Redis is back
        waiting = asyncio.create_task(source.next_batch(2, 0, 1, stop), name="next-batch")
        await asyncio.sleep(1.0)
        assert not waiting.done()  # still waiting, not failed
        server.start()
        await Producer(redis).publish(keys.trajectories(), [make_group("g2"), make_group("g3")])
        second = await asyncio.wait_for(waiting, 30)
        assert second is not None and [g.group_id for g in second.groups] == ["g2", "g3"]

        server.kill()
        acking = asyncio.create_task(source.commit_trained(first.deliveries + second.deliveries))
        await asyncio.sleep(1.0)
        assert not acking.done()
        server.start()
        await asyncio.wait_for(acking, 30)
        pending = await redis.xpending(keys.trajectories(), LEARNER_GROUP)
        assert pending["pending"] == 0  # every trained group acked once Redis was back
    finally:
        await redis.aclose()


async def test_commit_at_stop_gives_up_and_leaves_the_entries_pending(
    redis_factory: Callable[..., RedisServer],
) -> None:
    server = redis_factory(appendonly=True)
    keys = RunKeys("outage-stop")
    redis = await connect(RedisSettings.from_url(server.url))
    try:
        consumer = LiveSource.consumer_config("learner", ConsumerSettings(3600.0, 10))
        source = LiveSource(redis, keys, consumer, feeder=None, vocab_size=256)
        await source.start()
        await Producer(redis).publish(keys.trajectories(), [make_group("g0")])
        stop = asyncio.Event()
        batch = await source.next_batch(1, version=0, step=0, stop=stop)
        assert batch is not None
        server.kill()
        stop.set()
        with pytest.raises(RedisUnavailable):
            await asyncio.wait_for(source.commit_trained(batch.deliveries, stop), 10)
        server.start()
        pending = await redis.xpending(keys.trajectories(), LEARNER_GROUP)
        assert pending["pending"] == 1  # left pending for redelivery, not lost
    finally:
        await redis.aclose()
