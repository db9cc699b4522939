"""A worker's start-up: stopped while it imports, it ends at once; started beside a server that
is still loading (`farm up`), it takes no task until the server answers `/health`."""

from __future__ import annotations

import signal
import sys
from pathlib import Path

import pytest

from broker.keys import RunKeys
from broker.messages import ErrorCategory, Task
from inference.config import ServerConfig
from inference.server import PolicyServer
from tests.conftest import free_port
from tests.slow_import import stop_while_importing
from tests.workers.farm import publish_tasks, redis_client, wait_groups, wait_until


def test_a_worker_stopped_while_importing_ends_at_once(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    argv = [
        sys.executable,
        "-m",
        "workers",
        "--redis-url",
        f"redis://127.0.0.1:{free_port()}/0",
        "--inference-urls",
        f"http://127.0.0.1:{free_port()}",
        "--model",
        str(tiny_model_dir),
        "--env-modules",
        "slow_env_module",
    ]
    assert stop_while_importing(argv, tmp_path) == -signal.SIGTERM


@pytest.mark.slow
async def test_a_worker_takes_tasks_only_once_a_server_answers(
    redis_server, worker_factory, tiny_model_dir: Path
) -> None:
    keys = RunKeys("late")
    port = free_port()
    task = Task("late-0", 'wk-dialogue@{"turns": 1}', 2, seed=1, policy_version=0)
    async with redis_client(redis_server.url) as redis:
        await publish_tasks(redis, keys, [task])
        worker = worker_factory(redis_server.url, "late", [f"http://127.0.0.1:{port}"])

        async def waiting() -> bool:
            return "for an inference server to answer /health" in worker.output()

        await wait_until(waiting, 60, "the worker to wait for a server")
        # it has not read the task: nothing is pending, nothing can fail for want of a server
        read = await redis.xinfo_groups(keys.tasks)  # none yet, or one with nothing pending
        assert sum(g["pending"] for g in read) == 0
        server = PolicyServer(ServerConfig(model=tiny_model_dir, port=port))
        await server.start()
        try:
            [group] = await wait_groups(redis, keys, 1, 60)
        finally:
            await server.stop()
    assert group.task.task_id == "late-0"
    assert all(t.error is ErrorCategory.NONE for t in group.trajectories), group
