"""Faults inside one worker: an env that raises, an env that hangs, a dead inference server."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from broker.deadletters import list_dead_letters
from broker.keys import RunKeys
from broker.messages import ErrorCategory, Task, Truncation
from tests.workers import testenvs  # registers the test environments
from tests.workers.farm import (
    publish_tasks,
    redis_client,
    running_worker,
    wait_groups,
    wait_until,
)


async def test_env_that_raises_and_env_that_hangs(
    redis_server, policy_server, tiny_model_dir: Path
) -> None:
    keys = RunKeys("faults")
    tasks = [
        Task("raise", "wk-raise", group_size=2, seed=1, policy_version=0),
        Task("hang", "wk-hang", group_size=2, seed=1, policy_version=0),
        Task("fine", 'wk-dialogue@{"turns": 2}', group_size=2, seed=1, policy_version=0),
        Task("badspec", "no-such-env@{", group_size=1, seed=1, policy_version=0),
    ]
    async with redis_client(redis_server.url) as redis:
        await redis.xadd(keys.tasks, {b"k": b"task", b"v": b"1", b"b": b"\xc1garbage"})
        await publish_tasks(redis, keys, tasks)
        async with running_worker(
            redis,
            tiny_model_dir,
            [policy_server.url],
            run="faults",
            env_step_timeout_s=1.0,
            episode_timeout_s=5.0,
        ):
            found = {g.group_id: g for g in await wait_groups(redis, keys, 3, within_s=60)}
            await wait_until(lambda: _no_pending(redis, keys), 30, "every task acked")
        reasons = sorted(letter.reason for _, letter in await list_dead_letters(redis, keys))
    # the undecodable entry and the bad spec are dead letters, kept with their reasons
    assert set(found) == {"raise", "hang", "fine"}
    assert len(reasons) == 2 and reasons[0].startswith("task badspec: kwargs of spec")
    assert reasons[1].startswith("undecodable")
    raised, hung, fine = found["raise"], found["hang"], found["fine"]
    for t in raised.trajectories:
        assert (t.finish_reason, t.error) == ("error", ErrorCategory.ENV)
        assert "environment bug" in t.error_detail
    assert raised.infra_failed
    for t in hung.trajectories:
        assert (t.finish_reason, t.error) == ("error", ErrorCategory.TIMEOUT)
        assert t.timings["total"] < 4.0  # the step limit, not the episode limit, ended it
    for t in fine.trajectories:  # the worker survived both and still works
        assert (t.finish_reason, t.error) == ("terminated", ErrorCategory.NONE)
    assert not fine.infra_failed


async def test_permanent_task_errors_are_dead_letters_and_the_end_is_final(
    redis_server, policy_server, tiny_model_dir: Path
) -> None:
    keys = RunKeys("permanent")
    tasks = [
        Task("badname", "no-such-env", group_size=2, seed=1, policy_version=0),
        Task("badkwargs", 'wk-dialogue@{"colour": 1}', group_size=2, seed=1, policy_version=0),
        Task("unbuildable", "wk-unbuildable", group_size=3, seed=1, policy_version=0),
        Task("overrun", "wk-overrun", group_size=2, seed=40, policy_version=0),
    ]
    async with redis_client(redis_server.url) as redis:
        await publish_tasks(redis, keys, tasks)
        async with running_worker(
            redis, tiny_model_dir, [policy_server.url], run="permanent"
        ) as worker:
            found = {g.group_id: g for g in await wait_groups(redis, keys, 1, within_s=60)}
            await wait_until(lambda: _no_pending(redis, keys), 30, "every task acked")
        letters = [letter for _, letter in await list_dead_letters(redis, keys)]
    # Permanent task errors are dead letters after one attempt, never groups.
    assert set(found) == {"overrun"} and worker.tasks_dead_lettered == 3
    assert all(letter.deliveries == 1 for letter in letters)
    reasons = sorted(letter.reason for letter in letters)
    assert reasons[0].startswith("task badkwargs: bad kwargs for 'wk-dialogue'")
    assert "accepted kwargs: turns, step_s, pad" in reasons[0]
    assert reasons[1].startswith("task badname: unknown environment 'no-such-env'")
    assert reasons[2].startswith("task unbuildable: unknown source")  # raised by make
    # terminated ends the episode: the env is never stepped again, whatever it would answer
    assert [len(t.turns) for t in found["overrun"].trajectories] == [1, 1]
    assert testenvs.OVERRUN_STEPS == {40: [1, 1]}  # one task: both episodes reset with 40


async def _no_pending(redis: Any, keys: RunKeys) -> bool:
    """Every task was read and acked (a group published, or dead-lettered)."""
    groups = await redis.xinfo_groups(keys.tasks)
    return any(g["lag"] == 0 and g["pending"] == 0 for g in groups)


async def test_episode_limits_truncate_with_reason(
    redis_server, policy_server, tiny_model_dir: Path
) -> None:
    keys = RunKeys("limits")
    tasks = [
        Task(
            "turns",
            'wk-dialogue@{"turns": 50}',
            group_size=1,
            seed=1,
            policy_version=0,
            max_turns=3,
        ),
        Task(
            "ctx", 'wk-dialogue@{"turns": 50, "pad": 150}', group_size=1, seed=2, policy_version=0
        ),
    ]
    wall = Task("wall", 'wk-dialogue@{"turns": 100000}', group_size=1, seed=3, policy_version=0)
    urls = [policy_server.url]
    async with redis_client(redis_server.url) as redis:
        await publish_tasks(redis, keys, tasks)
        async with running_worker(
            redis, tiny_model_dir, urls, run="limits", max_context_tokens=400
        ):
            found = {g.group_id: g.trajectories[0] for g in await wait_groups(redis, keys, 2, 60)}
        await publish_tasks(redis, keys, [wall])
        async with running_worker(
            redis,
            tiny_model_dir,
            urls,
            run="limits",
            max_context_tokens=3500,
            max_turns=100000,
            episode_timeout_s=0.8,
            env_step_timeout_s=0.5,
        ):
            found |= {g.group_id: g.trajectories[0] for g in await wait_groups(redis, keys, 3, 60)}
    assert found["turns"].outcome == "truncated:max_turns" and len(found["turns"].turns) == 3
    assert found["turns"].truncation is Truncation.MAX_TURNS
    assert found["ctx"].truncation is Truncation.CONTEXT
    total = sum(len(t.prompt_ids) + len(t.completion_ids) for t in found["ctx"].turns)
    assert total <= 400 and len(found["ctx"].turns) < 4
    assert found["wall"].truncation is Truncation.WALL_TIME, found["wall"].outcome
    assert found["wall"].timings["total"] < 1.5
    for traj in found.values():
        assert traj.error is ErrorCategory.NONE and traj.turns[-1].truncated


@pytest.mark.slow
async def test_one_of_two_servers_killed_mid_run(
    redis_server, policy_server, server_factory, tiny_model_dir: Path
) -> None:
    keys = RunKeys("failover")
    # Only the server killed is the test's own: the survivor may be the shared one.
    a, b = server_factory(), policy_server
    tasks = [
        Task(
            f"t{i}",
            'wk-dialogue@{"turns": 3, "step_s": 0.05}',
            group_size=2,
            seed=10 * i,
            policy_version=0,
        )
        for i in range(6)
    ]
    async with redis_client(redis_server.url) as redis:
        await publish_tasks(redis, keys, tasks)
        async with running_worker(
            redis, tiny_model_dir, [a.url, b.url], run="failover", concurrency=16
        ):
            await wait_groups(redis, keys, 1, within_s=60)
            a.kill()
            found = await wait_groups(redis, keys, len(tasks), within_s=120)
    assert sorted(g.group_id for g in found) == sorted(t.task_id for t in tasks)
    for g in found:
        assert not g.infra_failed, [t.error_detail for t in g.trajectories]
        assert all(t.finish_reason == "terminated" for t in g.trajectories)
    await asyncio.sleep(0)
