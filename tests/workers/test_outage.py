"""Redis outages: worker processes ride out Redis restarts in a loop and lose nothing."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import pytest

from broker.keys import RunKeys
from broker.messages import Task
from tests.conftest import RedisServer
from tests.workers.conftest import Proc
from tests.workers.farm import pending_ids, publish_tasks, redis_client, wait_groups


@pytest.mark.slow
async def test_workers_survive_redis_restarts_while_committing(
    redis_factory: Callable[..., RedisServer],
    policy_server: Proc,
    worker_factory: Callable[..., Proc],
    tiny_model_dir: Path,
) -> None:
    server = redis_factory(appendonly=True)  # fsync always: a SIGKILL loses no commit
    keys = RunKeys("chaos")
    spec = 'wk-dialogue@{"turns": 2, "step_s": 0.05}'
    tasks = [Task(f"c{i}", spec, group_size=2, seed=i, policy_version=0) for i in range(40)]
    async with redis_client(server.url) as redis:
        await publish_tasks(redis, keys, tasks)
    workers = [
        worker_factory(
            server.url,
            "chaos",
            [policy_server.url],
            "--worker-id",
            f"w{i}",
            "--concurrency",
            "4",
            "--reclaim-idle-s",
            "6",
        )
        for i in range(2)
    ]
    async with redis_client(server.url) as redis:
        await wait_groups(redis, keys, 2, within_s=120)  # both are committing now
    restarts = 0
    while restarts < 8:
        server.restart()  # SIGKILL, then start on the same AOF
        restarts += 1
        await asyncio.sleep(0.7)
    async with redis_client(server.url) as redis:
        found = await wait_groups(redis, keys, len(tasks), within_s=240)
        assert await pending_ids(redis, keys) == []
    # Nothing lost and nothing twice: one group per task.
    assert sorted(g.group_id for g in found) == sorted(t.task_id for t in tasks)
    for w in workers:  # the same processes, still running
        assert w.process.poll() is None, w.output()[-3000:]
    logs = "".join(w.output() for w in workers)
    assert "Redis is back" in logs  # the outage was met, and ridden out
    assert "Traceback" not in logs
