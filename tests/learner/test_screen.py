"""The learner screens each read as a batch: already-trained and unusable groups are
settled in one commit (real redis-server; Redis's own command counts show the calls)."""

from __future__ import annotations

import asyncio

from broker.codec import decode
from broker.connection import RedisSettings, connect
from broker.consumer import ConsumerConfig
from broker.keys import LEARNER_GROUP, RunKeys
from broker.producer import Producer
from learner.source import LiveSource
from tests.conftest import RedisServer
from tests.learner.factories import make_group

KEYS = RunKeys("screen")


async def served(redis, command: str) -> int:
    """Calls of `command` Redis served successfully (those scripts ran included)."""
    row = (await redis.info("commandstats")).get(f"cmdstat_{command}", {})
    return int(row.get("calls", 0)) - int(row.get("failed_calls", 0))


async def test_a_read_with_trained_and_unusable_groups_settles_in_one_commit(
    redis_server: RedisServer,
) -> None:
    redis = await connect(RedisSettings.from_url(redis_server.url))
    try:
        groups = [
            make_group("trained", vocab=256),
            make_group("huge-ids", vocab=100_000),  # token ids outside a 256 vocabulary
            make_group("ok-1", vocab=256),
            make_group("ok-2", vocab=256),
        ]
        await Producer(redis).publish(KEYS.trajectories(), groups)
        config = ConsumerConfig(group=LEARNER_GROUP, consumer="learner", block_ms=200)
        source = LiveSource(redis, KEYS, config, None, 256, already_trained={"trained"})
        await source.start()
        scripts, acks = await served(redis, "evalsha"), await served(redis, "xack")
        batch = await source.next_batch(2, 0, 0, asyncio.Event())
        assert batch is not None and [g.group_id for g in batch.groups] == ["ok-1", "ok-2"]
        # one commit for the ack and the dead letter together, with one XACK
        assert await served(redis, "evalsha") - scripts == 1
        assert await served(redis, "xack") - acks == 1
        [(_, fields)] = await redis.xrange(KEYS.deadletter)
        letter = decode(fields)
        assert "huge-ids" in letter.reason and "vocabulary" in letter.reason
        # only the two buffered groups stay pending, to be acked after their checkpoint
        assert (await redis.xpending(KEYS.trajectories(), LEARNER_GROUP))["pending"] == 2
        assert source.already_trained == set() and len(source.released) == 2
    finally:
        await redis.aclose()
