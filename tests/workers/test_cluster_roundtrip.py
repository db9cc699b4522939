"""A short worker -> learner round trip over three partitions, on one node and on the
local Redis Cluster: the learner's feeder spreads tasks over the partitions' tasks
streams, a real worker commits each group to its task's partition, the learner's
`LiveSource` reads every partition, frees the slot of a dead-lettered task, and acks
what it trained; the books balance."""

from __future__ import annotations

import asyncio
from collections import Counter
from pathlib import Path

from broker.admission import AdmissionBudget
from broker.consumer import ConsumerSettings
from broker.keys import RunKeys
from broker.messages import Task
from broker.producer import Producer
from learner.health import DeadLetterWatch
from learner.source import LiveSource
from learner.tasks import (
    CurriculumRules,
    HorizonSchedule,
    TaskFeeder,
    TaskRow,
    TaskSampler,
    count_in_flight,
)
from tests.workers import testenvs  # noqa: F401  registers the test environments
from tests.workers.farm import redis_client, running_worker

KEYS = RunKeys("rt", partitions=3)


async def test_worker_to_learner_over_partitions(broker_url, policy_server, tiny_model_dir: Path):
    async with redis_client(broker_url) as redis:
        rows = [TaskRow('wk-dialogue@{"turns": 1}')]
        sampler = TaskSampler(rows, seed=0, rules=CurriculumRules())
        feeder = TaskFeeder(redis, KEYS, sampler, HorizonSchedule(), group_size=2, limit=8)
        await feeder.start(0)
        watch = DeadLetterWatch(redis, KEYS, limit=0)
        await watch.start()
        source = LiveSource(
            redis,
            KEYS,
            LiveSource.consumer_config("learner", ConsumerSettings()),
            feeder,
            vocab_size=1 << 20,
            dead_letters=watch,
        )
        await source.start()
        issued = await feeder.top_up(0, version=0, step=0)
        assert len(issued) == 8
        assert [await redis.xlen(s) for s in KEYS.all_tasks] == [3, 3, 2]  # round robin
        # one task no environment can serve, admitted like the others: a dead letter
        await feeder.set_limit(9)
        assert await feeder.budget.try_acquire(1) == 1
        bad = Task("rt-bad", "no-such-env@{}", group_size=2, seed=1, policy_version=0)
        await Producer(redis).publish(KEYS.task_stream(1), [bad])
        stop = asyncio.Event()
        async with running_worker(
            redis, tiny_model_dir, [policy_server.url], run=KEYS.run, partitions=3, concurrency=8
        ):
            batch = await asyncio.wait_for(source.next_batch(7, 0, 0, stop), 120)
            assert batch is not None
            await source.commit_trained(batch.deliveries)
            await asyncio.wait_for(_until_dead_letter_seen(source), 60)
        trained = Counter(g.group_id for g in batch.groups)
        assert len(trained) == 7 and max(trained.values()) == 1  # nothing trained twice
        assert bad.task_id not in trained
        assert {KEYS.partition_of(d.stream) for d in batch.deliveries} == {0, 1, 2}
        # the books: every issued task is trained or in flight (a task pending or not yet
        # read, or its group published and not yet acked); the dead letter is neither
        in_flight = await count_in_flight(redis, KEYS, "workers", "learner")
        assert len(issued) + source.issued == len(trained) + in_flight
        # the budget holds a slot for what is in flight, minus the groups the learner has
        # read already (buffered), and none for the dead letter
        read = len(source.buffer) + len(source.unscreened)
        assert await AdmissionBudget(redis, KEYS).in_flight() == in_flight - read
        letters = [await redis.xlen(KEYS.deadletter_of(p)) for p in range(3)]
        assert letters == [0, 1, 0]


async def _until_dead_letter_seen(source: LiveSource) -> None:
    """Once the worker has dead-lettered the bad task, the learner's next look at the
    letters (if no earlier one did) frees its slot."""
    letters = {KEYS.deadletter_of(1): "0-0"}
    while not await source.redis.xread(letters, count=1, block=1000):  # blocks until one is there
        pass
    await source._watch_dead_letters()
