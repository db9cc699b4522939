"""Runs that train nothing, with a real learner process and real Redis.

The test plays the workers: it takes the tasks the learner issues through the workers'
consumer group and answers each with a group, published and acked in one commit, as a
worker does. Groups are scripted per case:

* the model scores 0 everywhere: every batch is skipped, which is not a step (the
  policy version, the weights on the server and --max-steps stay where they are), the
  groups are acked and counted, admission keeps issuing at version 0, and the learner
  keeps running; the first trainable batch is then step 1 and the only weight push;
* every episode fails with a sandbox error: after --max-failed-batches spoiled batches in
  a row the learner exits 3 naming the category and an example; a zero-score batch in
  between resets the count (that is learning, not failure);
* the workers dead-letter every task: each frees its admission slot, and the learner exits 3
  with the workers' reason once they pile up with no group coming back.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from broker.admission import AdmissionBudget
from broker.connection import RedisSettings, connect
from broker.consumer import Consumer, ConsumerConfig
from broker.keys import LEARNER_GROUP, WORKERS_GROUP, RunKeys
from broker.messages import ErrorCategory, Task, TrajectoryGroup
from broker.policy import current_policy
from tests.conftest import RedisServer
from tests.learner.factories import make_group
from tests.learner.farm import farm, toy_tasks

GPB, GROUP_SIZE, LIMIT = 2, 2, 4  # max_staleness 1: (1 + 1) x 2 tasks in flight at most
Script = Callable[[int, Task], TrajectoryGroup | str]  # n-th task -> its group, or a dead letter


def learner_args(model: Path, url: str, run: str, work: Path, *extra: str) -> list[str]:
    return [
        "learner",
        "--model",
        str(model),
        "--redis-url",
        url,
        "--run",
        run,
        "--tasks",
        str(toy_tasks(work / "tasks.jsonl")),
        "--groups-per-batch",
        str(GPB),
        "--group-size",
        str(GROUP_SIZE),
        "--max-staleness",
        "1",
        "--max-steps",
        "1",
        "--checkpoint-dir",
        str(work / "ckpt"),
        "--weights-dir",
        str(work / "weights"),
        "--max-failed-batches",
        "2",
        "--learning-rate",
        "1e-3",
        *extra,
    ]


def zero(_: int, task: Task) -> TrajectoryGroup:
    return _answer(task, [0.0, 0.0])


def trainable(_: int, task: Task) -> TrajectoryGroup:
    return _answer(task, [0.0, 1.0])


def sandbox_failed(_: int, task: Task) -> TrajectoryGroup:
    group = _answer(task, [0.0, 0.0])
    detail = "SandboxError: container pool exhausted"
    broken = tuple(
        dataclasses.replace(
            t, finish_reason="error", error=ErrorCategory.SANDBOX, error_detail=detail
        )
        for t in group.trajectories
    )
    return dataclasses.replace(group, trajectories=broken)


def _answer(task: Task, rewards: list[float]) -> TrajectoryGroup:
    made = make_group(task.task_id, rewards, vocab=256, version=task.policy_version)
    return dataclasses.replace(made, task=task)


async def play_workers(
    url: str, keys: RunKeys, script: Script, tasks: int, proc: subprocess.Popen[bytes]
) -> list[Task]:
    """Answer `tasks` tasks as a worker would; return them. Checks the budget each time."""
    redis = await connect(RedisSettings.from_url(url))
    consumer = Consumer(
        redis,
        keys,
        [keys.tasks],
        expect=Task,
        config=ConsumerConfig(group=WORKERS_GROUP, consumer="test-worker", block_ms=200),
    )
    budget = AdmissionBudget(redis, keys)
    seen: list[Task] = []
    try:
        await consumer.ensure_groups()
        deadline = time.monotonic() + 120
        while len(seen) < tasks:
            assert time.monotonic() < deadline, "the learner stopped issuing tasks"
            if proc.poll() is not None:
                break
            for delivery in await consumer.read(count=1):
                assert isinstance(delivery.message, Task)
                assert await budget.in_flight() <= LIMIT
                answer = script(len(seen), delivery.message)
                seen.append(delivery.message)
                if isinstance(answer, str):
                    await consumer.dead_letter(delivery, answer)
                else:
                    await consumer.commit([delivery], publish=[(keys.trajectories(), answer)])
    finally:
        await redis.aclose()
    return seen


def events(log: str, kind: str) -> list[dict[str, object]]:
    return [
        json.loads(line.split(" learner ", 1)[1])
        for line in log.splitlines()
        if f'"event": "{kind}"' in line
    ]


def wait_exit(proc: subprocess.Popen[bytes], timeout: float) -> int:
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired as exc:
        raise AssertionError("the learner did not stop") from exc


async def wait_for(log: Callable[[], str], needle: str, count: int, within_s: float) -> None:
    deadline = time.monotonic() + within_s
    while log().count(needle) < count:
        assert time.monotonic() < deadline, f"fewer than {count} {needle!r} in {log()[-3000:]}"
        await asyncio.sleep(0.1)


async def learner_pending(url: str, keys: RunKeys) -> int:
    redis = await connect(RedisSettings.from_url(url))
    try:
        return int((await redis.xpending(keys.trajectories(), LEARNER_GROUP))["pending"])
    finally:
        await redis.aclose()


@pytest.mark.slow
async def test_zero_score_everywhere_keeps_running_and_is_not_a_step(
    redis_server: RedisServer, tiny_model_dir: Path, tmp_path: Path
) -> None:
    keys = RunKeys("zeros")
    with farm(tmp_path) as f:
        server = f.server("server", tiny_model_dir)
        proc = f.spawn(
            "learner",
            learner_args(
                tiny_model_dir,
                redis_server.url,
                keys.run,
                tmp_path,
                "--inference-urls",
                server,
                "--idle-warn-batches",
                "4",
            ),
        )
        zeros = await play_workers(redis_server.url, keys, zero, 12, proc)  # six batches
        await wait_for(lambda: f.log("learner"), '"event": "skipped"', 6, 60)
        assert proc.poll() is None, "a run where the model scores 0 must keep running"
        assert all(t.policy_version == 0 for t in zeros)  # the version never moved
        redis = await connect(RedisSettings.from_url(redis_server.url))
        policy = await current_policy(redis, keys)
        await redis.aclose()
        assert policy is not None and policy.version == 0
        assert not (tmp_path / "weights").exists() or not any((tmp_path / "weights").iterdir())
        assert await learner_pending(redis_server.url, keys) == 0  # skipped groups are acked
        # the first trainable batch is step 1 (max-steps 1): trained, pushed, done
        await play_workers(redis_server.url, keys, trainable, GPB, proc)
        assert wait_exit(proc, 120) == 0, f.log("learner")[-3000:]
        log = f.log("learner")
    skipped, steps = events(log, "skipped"), events(log, "step")
    assert len(skipped) >= 6 and all(s["step"] == 0 and s["version"] == 0 for s in skipped)
    assert all(s["zero_variance"] == GPB for s in skipped)
    assert all(s["zero_variance_reward"] == 0.0 for s in skipped)  # what they all scored
    # one WARNING at the 4th idle batch (the next is due at the 8th), and word when it ends
    assert log.count("WARNING learner 4 batches in a row trained nothing") == 1, log[-3000:]
    assert "(all 0.0: too hard)" in log and "--dynamic-sampling" in log
    assert f"training again at step 1 after {len(skipped)} idle batches" in log
    assert [(s["step"], s["version"]) for s in steps] == [(1, 1)]
    assert len(list((tmp_path / "weights").iterdir())) == 1  # one push, for step 1
    done = events(log, "done")[0]
    assert done["counters"]["skipped_batches"] == len(skipped)  # type: ignore[index]
    assert done["counters"]["zero_variance"] >= 2 * len(skipped)  # type: ignore[index]


@pytest.mark.slow
async def test_every_episode_failing_stops_the_learner_naming_the_error(
    redis_server: RedisServer, tiny_model_dir: Path, tmp_path: Path
) -> None:
    keys = RunKeys("failing")
    # batches: spoiled, zero-score (resets the streak), spoiled, spoiled -> stop at the 4th
    plan = [sandbox_failed] * 2 + [zero] * 2 + [sandbox_failed] * 4
    with farm(tmp_path) as f:
        proc = f.spawn(
            "learner", learner_args(tiny_model_dir, redis_server.url, keys.run, tmp_path)
        )
        await play_workers(redis_server.url, keys, lambda n, t: plan[n](n, t), len(plan), proc)
        assert wait_exit(proc, 90) == 3, f.log("learner")[-3000:]
        log = f.log("learner")
    assert len(events(log, "skipped")) == 4 and not events(log, "step")
    failure = [line for line in log.splitlines() if "the run is failing" in line]
    assert len(failure) == 1
    assert "2 batches in a row had no trainable sample" in failure[0]
    assert "mostly 'sandbox' (8 of 8 failed episodes)" in failure[0]
    assert "example: SandboxError: container pool exhausted" in failure[0]
    assert await learner_pending(redis_server.url, keys) == 0


@pytest.mark.slow
async def test_tasks_all_dead_lettered_free_their_slots_then_stop_the_learner(
    redis_server: RedisServer, tiny_model_dir: Path, tmp_path: Path
) -> None:
    keys = RunKeys("deadtasks")
    reason = "task x: unknown codegym environment 'nope'"
    with farm(tmp_path) as f:
        proc = f.spawn(
            "learner",
            learner_args(
                tiny_model_dir, redis_server.url, keys.run, tmp_path, "--max-failed-batches", "3"
            ),
        )
        # 3 x 2 = 6 dead letters in a row stop it: more than the budget of 4, so only if the
        # dead-lettered tasks gave their slots back
        dead = await play_workers(redis_server.url, keys, lambda n, t: reason, 10, proc)
        assert wait_exit(proc, 90) == 3, f.log("learner")[-3000:]
        log = f.log("learner")
    assert len(dead) > LIMIT, "dead-lettered tasks must give their admission slots back"
    failure = [line for line in log.splitlines() if "the run is failing" in line]
    assert len(failure) == 1 and "dead-lettered by the workers" in failure[0]
    assert f"latest reason: {reason}" in failure[0]
