"""learner.health on its own: which batches count as spoiled, and dead letters of tasks."""

from __future__ import annotations

import dataclasses

import pytest

from broker.connection import RedisSettings, connect
from broker.keys import RunKeys
from broker.messages import DeadLetter, ErrorCategory, TrajectoryGroup
from broker.producer import Producer
from learner.errors import RunFailedError
from learner.health import DeadLetterWatch, FailureWatch, spoiled
from tests.conftest import RedisServer
from tests.learner.factories import make_group


def failed(group_id: str, category: ErrorCategory, detail: str) -> TrajectoryGroup:
    group = make_group(group_id, [0.0, 0.0])
    broken = tuple(
        dataclasses.replace(t, error=category, error_detail=detail) for t in group.trajectories
    )
    return dataclasses.replace(group, trajectories=broken)


def test_only_batches_the_infrastructure_spoiled_count() -> None:
    sandbox = failed("a", ErrorCategory.SANDBOX, "SandboxError: no container")
    zero = make_group("z", [0.0, 0.0])  # the model scored 0: not infra
    timeout = failed("t", ErrorCategory.TIMEOUT, "env exceeded the time limit")  # the model's
    assert spoiled([sandbox, sandbox], 0)
    assert not spoiled([sandbox, zero], 0)
    assert not spoiled([zero, zero], 0)
    assert not spoiled([timeout], 0)
    assert not spoiled([sandbox], 3)  # something trained
    assert not spoiled([], 0)


def test_the_streak_stops_the_run_naming_the_dominant_category_and_an_example() -> None:
    watch = FailureWatch(limit=3)
    sandbox = failed("s", ErrorCategory.SANDBOX, "SandboxError: pool exhausted")
    env = failed("e", ErrorCategory.ENV, "RuntimeError: env bug")
    zero = make_group("z", [0.0, 0.0])
    watch.observe([sandbox, env], 0)
    watch.observe([sandbox, sandbox], 0)
    watch.observe([zero, zero], 0)  # learning, not failure: the streak starts over
    assert watch.streak == 0
    watch.observe([sandbox, env], 0)
    watch.observe([sandbox, sandbox], 0)
    with pytest.raises(RunFailedError) as caught:
        watch.observe([env, sandbox], 0)
    assert str(caught.value) == (
        "3 batches in a row had no trainable sample: every group failed with an infrastructure "
        "error, mostly 'sandbox' (8 of 12 failed episodes); example: SandboxError: pool exhausted"
    )
    never = FailureWatch(limit=0)
    for _ in range(50):
        never.observe([sandbox], 0)


async def test_dead_letter_watch_counts_new_task_letters_only(redis_server: RedisServer) -> None:
    keys = RunKeys("health")
    redis = await connect(RedisSettings.from_url(redis_server.url))
    producer = Producer(redis)

    def letter(source: str, reason: str) -> DeadLetter:
        return DeadLetter(source_stream=source, entry_id="1-0", reason=reason, fields={})

    try:
        await producer.publish(keys.deadletter, [letter(keys.tasks, "before the learner")])
        watch = DeadLetterWatch(redis, keys, limit=3)
        await watch.start()
        assert await watch.poll() == 0  # already there: not in the slots counted in flight
        await producer.publish(
            keys.deadletter,
            [
                letter(keys.tasks, "task a: bad"),
                letter(keys.trajectories(), "group g: bad"),
                letter(keys.tasks, "task b: worse"),
            ],
        )
        await redis.xadd(keys.deadletter, {b"k": b"deadletter", b"v": b"1", b"b": b"\xc1"})
        assert await watch.poll() == 2 and watch.latest == "task b: worse"
        watch.check()  # 2 < 3
        watch.groups_arrived()
        await producer.publish(keys.deadletter, [letter(keys.tasks, f"task {i}") for i in "cde"])
        assert await watch.poll() == 3
        with pytest.raises(RunFailedError, match=r"3 tasks in a row .* latest reason: task e"):
            watch.check()
    finally:
        await redis.aclose()
