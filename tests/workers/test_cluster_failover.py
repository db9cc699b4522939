"""Chaos: SIGKILL the master that owns a run's slot mid-run, on a real local Redis Cluster.

A worker and the learner's `LiveSource` (each with its own cluster client) run a
three-partition run; after the second trained batch the master serving the run's
partition 0 (tasks, admission budget, policy) is SIGKILLed. Its replica is promoted
(cluster-node-timeout 1 s), both sides ride the outage out (`RedisUnavailable` +
backoff) and the run finishes. The killed node comes back 4 s later (as a restarted
pod would) and rejoins as the new master's replica: until then a shard has no replica,
so with ``wait_replicas=1`` its commits cannot count and the run pauses. Then the books: every task issued is trained, in
flight or dead-lettered; nothing trained twice; every acked commit (the workers' and
the learner's seen marks) is on the promoted replica, and the admission budget counts
exactly the tasks issued and not yet read.

With ``wait_replicas=1`` those books are guaranteed: a commit or task publish returns
only once a replica holds it. With 0 they hold unless the kill lands inside the
replication window of a write (well under a millisecond on loopback): the risk that
docs/deploy.md states, and that this variant would reveal as a failure.
"""

from __future__ import annotations

import asyncio
import shutil
import time
from collections import Counter
from pathlib import Path

import pytest

from broker.admission import AdmissionBudget
from broker.consumer import ConsumerSettings
from broker.keys import LEARNER_GROUP, WORKERS_GROUP, RunKeys
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
from tests.cluster import LocalCluster
from tests.conftest import require
from tests.workers import testenvs  # noqa: F401  registers the test environments
from tests.workers.farm import redis_client, running_worker

KEYS = RunKeys("fo", partitions=3)
STEPS, BATCH = 6, 4


@pytest.fixture
def cluster(tmp_path: Path):
    found = shutil.which("redis-server") is not None and shutil.which("redis-cli") is not None
    require(found, "redis-server and redis-cli")
    made = LocalCluster(tmp_path / "cluster")
    try:
        made.start()
        yield made
    finally:
        made.stop()


@pytest.mark.slow
@pytest.mark.parametrize("wait_replicas", [0, 1])
async def test_master_sigkill_mid_run_loses_nothing(
    cluster: LocalCluster, wait_replicas: int, policy_server, tiny_model_dir: Path
) -> None:
    settings = {"reclaim_idle_s": 3.0, "wait_replicas": wait_replicas}
    async with redis_client(cluster.url) as redis, redis_client(cluster.url) as worker_redis:
        rows = [TaskRow('wk-dialogue@{"turns": 2, "step_s": 0.1}')]
        producer = Producer(redis, wait_replicas)
        budget = AdmissionBudget(redis, KEYS, wait_replicas)
        feeder = TaskFeeder(
            redis,
            KEYS,
            TaskSampler(rows, 0, CurriculumRules()),
            HorizonSchedule(),
            group_size=2,
            limit=12,
            producer=producer,
            budget=budget,
        )
        await feeder.start(0)
        watch = DeadLetterWatch(redis, KEYS, limit=0)
        await watch.start()
        config = LiveSource.consumer_config("learner", ConsumerSettings(**settings))
        source = LiveSource(redis, KEYS, config, feeder, 1 << 20, dead_letters=watch)
        await source.start()
        issued = len(await feeder.top_up(0, version=0, step=0))
        victim = cluster.master_of(KEYS.tasks)
        trained: Counter[str] = Counter()
        stop = asyncio.Event()
        async with running_worker(
            worker_redis,
            tiny_model_dir,
            [policy_server.url],
            run=KEYS.run,
            partitions=3,
            concurrency=8,
            consumer=settings,
        ):
            for step in range(STEPS):
                batch = await asyncio.wait_for(source.next_batch(BATCH, 0, step, stop), 120)
                assert batch is not None
                trained.update(g.group_id for g in batch.groups)
                await asyncio.wait_for(source.commit_trained(batch.deliveries), 60)
                if step == 1:
                    cluster.kill(victim)  # SIGKILL while the worker is mid-task
                    # like a restarted pod: back after a while, as the new master's replica
                    back = asyncio.create_task(asyncio.to_thread(_restart, cluster, victim, 4.0))
            await back
        promoted = cluster.master_of(KEYS.tasks)
        assert promoted != victim  # the replica took over the slot
        assert len(trained) == STEPS * BATCH and max(trained.values()) == 1  # none twice
        dead = sum([await redis.xlen(s) for s in KEYS.all_deadletters])
        in_flight = await _in_flight(redis)
        assert await count_in_flight(redis, KEYS, WORKERS_GROUP, LEARNER_GROUP) == in_flight
        assert issued + source.issued == len(trained) + in_flight + dead  # none lost
        assert dead == 0
        # The budget survived the failover: a slot for every task issued and not yet read
        # by the learner (each read frees one, trained or still buffered).
        read = len(trained) + len(source.buffer)
        assert await budget.in_flight() == issued + source.issued - read
        # every acked commit is on the promoted master (once a replica of the victim)
        for group_id in trained:
            marks = [
                await redis.zscore(KEYS.seen(group, p), group_id)
                for group in (WORKERS_GROUP, LEARNER_GROUP)
                for p in range(KEYS.partitions)
            ]
            assert sum(m is not None for m in marks) == 2, group_id


async def _in_flight(redis) -> int:
    """Tasks issued and not yet trained, exactly: entries past each group's last delivered
    id plus its pending ones, read off the streams whole (the oracle `count_in_flight`,
    which a restarted learner uses, must agree with, lag or no lag after the failover)."""
    total = 0
    streams = [(s, WORKERS_GROUP) for s in KEYS.all_tasks]
    streams += [(s, LEARNER_GROUP) for s in KEYS.all_trajectories]
    for stream, group in streams:
        [info] = [g for g in await redis.xinfo_groups(stream) if g["name"] == group.encode()]
        last = info["last-delivered-id"].decode()
        total += len(await redis.xrange(stream, min=f"({last}")) + int(info["pending"])
    return total


def _restart(cluster: LocalCluster, port: int, after_s: float) -> None:
    time.sleep(after_s)
    cluster.restart(port)
