"""SIGKILL mid-run, then --resume: every group is trained exactly once; bad entries are
dead-lettered without stopping the learner.

Groups are published into Redis directly (no workers needed). The learner checkpoints
every 3 steps and acks only after a checkpoint, so the kill after step 5 leaves steps
4-5 trained but unacked; the resumed learner rolls back to step 3 and gets those
entries back first. The checkpointed state records the group ids of every step.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from broker.connection import RedisSettings, connect
from broker.keys import LEARNER_GROUP, RunKeys
from broker.producer import Producer
from learner.checkpoint import latest_checkpoint, load_state
from tests.conftest import RedisServer
from tests.learner.factories import make_group

RUN = "resume"
KEYS = RunKeys(RUN)


def learner_cmd(model: Path, redis_url: str, ckpt: Path, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "learner",
        "--model",
        str(model),
        "--redis-url",
        redis_url,
        "--run",
        RUN,
        "--groups-per-batch",
        "4",
        "--checkpoint-interval",
        "3",
        "--max-steps",
        "10",
        "--checkpoint-dir",
        str(ckpt),
        "--learning-rate",
        "1e-3",
        "--seed",
        "1",
        *extra,
    ]


async def publish(url: str, items: list[object]) -> None:
    """Publish groups, and raw entry fields (dicts) as they are, in order."""
    redis = await connect(RedisSettings.from_url(url))
    producer = Producer(redis)
    for item in items:
        if isinstance(item, dict):
            await producer.publish_raw(KEYS.trajectories(), [item])
        else:
            await producer.publish(KEYS.trajectories(), [item])  # type: ignore[list-item]
    await redis.aclose()


def wait_for_line(log: Path, needle: str, proc: subprocess.Popen[bytes], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if needle in log.read_text():
            return
        assert proc.poll() is None, log.read_text()[-3000:]
        time.sleep(0.05)
    raise AssertionError(f"no {needle!r} in {log.read_text()[-3000:]}")


async def pending_and_dead(url: str) -> tuple[int, int]:
    redis = await connect(RedisSettings.from_url(url))
    pending = (await redis.xpending(KEYS.trajectories(), LEARNER_GROUP))["pending"]
    dead = await redis.xlen(KEYS.deadletter)
    await redis.aclose()
    return int(pending), int(dead)


@pytest.mark.slow
def test_sigkill_then_resume_trains_every_group_exactly_once(
    redis_server: RedisServer, tiny_model_dir: Path, tmp_path: Path
) -> None:
    ids = [f"grp-{i:02d}" for i in range(40)]
    rewards = [[0.0, 1.0], [1.0, 0.0], [0.0, 0.5, 1.0]]
    groups = [make_group(g, rewards[i % 3], vocab=256) for i, g in enumerate(ids)]
    asyncio.run(publish(redis_server.url, groups[:20]))
    ckpt, log = tmp_path / "ckpt", tmp_path / "first.log"
    with open(log, "wb") as out:
        first = subprocess.Popen(
            learner_cmd(tiny_model_dir, redis_server.url, ckpt),
            stdout=out,
            stderr=subprocess.STDOUT,
        )
        try:
            # only 20 groups exist: after step 5 the learner blocks waiting for more
            wait_for_line(log, '"step": 5,', first, timeout=90)
        finally:
            os.kill(first.pid, signal.SIGKILL)
            first.wait(10)
    before = load_state(latest_checkpoint(ckpt))  # type: ignore[arg-type]
    assert before.step == 3, "the kill must land between checkpoints for the test to mean anything"
    assert asyncio.run(pending_and_dead(redis_server.url))[0] == 8  # steps 4-5 trained, unacked

    garbage = {b"k": b"group", b"v": b"1", b"b": b"\xc1not msgpack"}
    too_big = make_group("grp-out-of-vocab", [0.0, 1.0], vocab=10_000)
    asyncio.run(
        publish(redis_server.url, [*groups[20:25], garbage, *groups[25:30], too_big, *groups[30:]])
    )
    resumed = subprocess.run(
        learner_cmd(tiny_model_dir, redis_server.url, ckpt, "--resume"),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stderr

    state = load_state(latest_checkpoint(ckpt))  # type: ignore[arg-type]
    assert state.step == 10 and len(state.trained) == 10
    trained = Counter(g for step in state.trained for g in step)
    assert set(trained) == set(ids), "a group was skipped (or a bad one trained)"
    assert max(trained.values()) == 1, "a group was trained twice"
    assert state.trained[:3] == before.trained  # history up to the checkpoint is kept as is
    pending, dead = asyncio.run(pending_and_dead(redis_server.url))
    assert pending == 0 and dead == 2  # everything acked; garbage + out-of-vocab dead-lettered
    done = [
        json.loads(line.split(" learner ", 1)[1])
        for line in resumed.stderr.splitlines()
        if '"event": "done"' in line
    ]
    assert done and done[0]["counters"]["groups"] == 40


async def test_groups_the_checkpoint_holds_are_acked_not_trained(redis_server: RedisServer) -> None:
    """A kill between writing a checkpoint and acking its entries leaves them pending while
    the checkpoint already holds their effect: the resumed learner acks them untrained."""
    from broker.consumer import ConsumerConfig
    from learner.source import LiveSource

    await publish(redis_server.url, [make_group(f"c-{i}", vocab=256) for i in range(3)])
    redis = await connect(RedisSettings.from_url(redis_server.url))
    try:
        config = ConsumerConfig(group=LEARNER_GROUP, consumer="learner", block_ms=200)
        source = LiveSource(redis, KEYS, config, None, 256, already_trained={"c-0", "c-1"})
        await source.start()
        batch = await source.next_batch(1, 0, 0, asyncio.Event())
        assert batch is not None and [g.group_id for g in batch.groups] == ["c-2"]
        assert (await redis.xpending(KEYS.trajectories(), LEARNER_GROUP))["pending"] == 1
    finally:
        await redis.aclose()
