"""The learner exports the run's stream gauges from Redis while it runs (broker.status)."""

from __future__ import annotations

import asyncio

from prometheus_client import REGISTRY

from broker.admission import AdmissionBudget
from broker.connection import RedisSettings, connect
from broker.keys import WORKERS_GROUP, RunKeys
from broker.messages import Task
from broker.producer import Producer
from broker.status import export_stream_gauges
from tests.broker.helpers import task_consumer


async def test_stream_gauges_follow_redis(redis_server):
    redis = await connect(RedisSettings.from_url(redis_server.url))
    keys = RunKeys("gauges")
    try:
        await Producer(redis).publish(
            keys.tasks, [Task(f"t{i}", "toy@{}", 1, i, 0) for i in range(5)]
        )
        c = task_consumer(redis, keys, "w")
        await c.ensure_groups()
        await c.read(count=2)  # 2 pending, 3 not yet delivered
        budget = AdmissionBudget(redis, keys)
        await budget.set_limit(9)
        await budget.try_acquire(4)
        await redis.hset(keys.admission, "in_flight", 3)  # another process released one

        def value(name: str, **labels: str) -> float | None:
            return REGISTRY.get_sample_value(name, labels)

        task = asyncio.create_task(export_stream_gauges(redis, keys, period_s=2.0))
        # The first export runs at once and writes the admission gauges last (this process
        # set them to 4/9 above; Redis says 3). A fixed sleep and a 50 ms period, which is
        # also the refresh timeout, failed under load.
        deadline = asyncio.get_running_loop().time() + 10
        while value("farm_admission_in_flight") != 3:
            assert asyncio.get_running_loop().time() < deadline, "no export in 10 s"
            await asyncio.sleep(0.05)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

        assert value("farm_stream_length_entries", stream=keys.tasks) == 5
        assert value("farm_stream_pending_entries", stream=keys.tasks, group=WORKERS_GROUP) == 2
        assert value("farm_stream_lag_entries", stream=keys.tasks, group=WORKERS_GROUP) == 3
        assert value("farm_admission_in_flight") == 3
        assert value("farm_admission_limit") == 9
    finally:
        await redis.aclose()
