"""Helpers for the worker integration tests: publish tasks, read back groups, run a worker."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from redis.exceptions import ResponseError

from broker.codec import decode
from broker.connection import RedisSettings, connect
from broker.keys import WORKERS_GROUP, RunKeys
from broker.messages import Task, TrajectoryGroup
from broker.producer import Producer
from inference.client import GenerationClient, SamplingParams
from inference.config import ClientConfig
from workers.config import WorkerConfig
from workers.episode import EpisodeContext
from workers.tokens import load_codec
from workers.worker import Worker


async def publish_tasks(redis: Any, keys: RunKeys, tasks: Sequence[Task]) -> None:
    await Producer(redis).publish(keys.tasks, list(tasks))


async def groups(redis: Any, keys: RunKeys) -> list[TrajectoryGroup]:
    entries = await redis.xrange(keys.trajectories())
    out = [decode(fields, expect=TrajectoryGroup) for _, fields in entries]
    return [g for g in out if isinstance(g, TrajectoryGroup)]


async def wait_groups(redis: Any, keys: RunKeys, n: int, within_s: float) -> list[TrajectoryGroup]:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        found = await groups(redis, keys)
        if len(found) >= n:
            return found
        await asyncio.sleep(0.2)
    raise AssertionError(f"only {len(await groups(redis, keys))} of {n} groups within {within_s}s")


async def pending_ids(redis: Any, keys: RunKeys) -> list[str]:
    rows = await redis.xpending_range(keys.tasks, WORKERS_GROUP, "-", "+", 1000)
    return [r["message_id"].decode() for r in rows]


@asynccontextmanager
async def redis_client(url: str) -> AsyncIterator[Any]:
    redis = await connect(RedisSettings.from_url(url))
    try:
        yield redis
    finally:
        await redis.aclose()


@asynccontextmanager
async def running_worker(
    redis: Any, model: Path, urls: list[str], **overrides: Any
) -> AsyncIterator[Worker]:
    """A Worker running in this process until the block exits (then stopped and drained)."""
    cfg = WorkerConfig.load({"inference_urls": urls, "model": model, "max_tokens": 6, **overrides})
    client = GenerationClient(urls, ClientConfig(request_timeout_s=10, retry_budget_s=10))
    await client.start()
    ctx = EpisodeContext(codec=load_codec(str(model)), client=client, sampling=SamplingParams)
    worker = Worker(cfg, redis, ctx)
    stop = asyncio.Event()
    task = asyncio.create_task(worker.run(stop), name="test-worker")
    try:
        yield worker
    finally:
        stop.set()
        await asyncio.wait_for(task, 60)
        await client.close()


async def pending_by_consumer(redis: Any, keys: RunKeys) -> dict[str, int]:
    try:
        info = await redis.xpending(keys.tasks, WORKERS_GROUP)
    except ResponseError:  # no group yet: no worker has started
        return {}
    return {c["name"].decode(): int(c["pending"]) for c in info.get("consumers") or []}


async def wait_until(predicate: Any, within_s: float, what: str) -> None:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if await predicate():
            return
        await asyncio.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")
