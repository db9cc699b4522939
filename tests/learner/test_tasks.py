"""Task source: dataset validation, curriculum, horizon, and feeding inside the budget."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from redis import Redis

from broker.connection import RedisSettings, connect
from broker.keys import RunKeys
from broker.messages import EvalMark, Task
from broker.producer import Producer
from learner.errors import TaskSourceError
from learner.tasks import (
    CurriculumRules,
    HorizonSchedule,
    TaskFeeder,
    TaskRow,
    TaskSampler,
    count_in_flight,
    load_dataset,
)
from tests.conftest import RedisServer


def test_dataset_errors_name_the_line(tmp_path: Path) -> None:
    good = tmp_path / "ok.jsonl"
    good.write_text('{"env_spec": "toy@{}"}\n\n{"env_spec": "toy@{}", "difficulty": 2}\n')
    assert [r.difficulty for r in load_dataset(good)] == [0, 2]
    for body, complaint in [
        ('{"env_spec": "toy@{}"}\nnot json\n', ":2:"),
        ('{"env_spec": ""}\n', "env_spec must be a non-empty string"),
        ('{"env_spec": "toy", "colour": 1}\n', "unknown keys ['colour']"),
        ("[1, 2]\n", "not a JSON object"),
        ("\n", "has no rows"),
    ]:
        bad = tmp_path / "bad.jsonl"
        bad.write_text(body)
        with pytest.raises(
            TaskSourceError, match=complaint.replace("[", r"\[").replace("]", r"\]")
        ):
            load_dataset(bad)
    with pytest.raises(TaskSourceError, match="cannot read"):
        load_dataset(tmp_path / "missing.jsonl")


GOOD = '{"env_spec": "toy@{\\"difficulty\\": 1}"}\n'


@pytest.mark.parametrize(
    ("spec", "fragments"),
    [
        (
            "nope@{}",
            ["unknown environment 'nope'", "registered: agent, arith, calc, code, codegym"],
        ),
        ("toy@{bad", ["not valid JSON"]),
        (
            "codegym",
            ["missing a required argument: 'env'", "accepted kwargs: env (required), config_index"],
        ),
        (
            'toy@{"difficulty": 7}',
            [
                "difficulty: Input should be less than or equal to 3",
                "accepted kwargs: difficulty, instructions",
            ],
        ),
    ],
)
def test_one_bad_spec_in_a_good_dataset_names_its_line(
    tmp_path: Path, spec: str, fragments: list[str]
) -> None:
    path = tmp_path / "tasks.jsonl"
    path.write_text(GOOD * 2 + json.dumps({"env_spec": spec}) + "\n" + GOOD)
    with pytest.raises(TaskSourceError) as caught:
        load_dataset(path)
    message = str(caught.value)
    assert message.startswith(f"{path}:3: bad env_spec ") and "\n" not in message
    for fragment in fragments:
        assert fragment in message


def test_a_bad_dataset_stops_the_learner_before_any_task(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    path = tmp_path / "tasks.jsonl"
    path.write_text(GOOD + '{"env_spec": "codegym"}\n')
    argv = [
        sys.executable,
        "-m",
        "learner",
        "--model",
        str(tmp_path / "no-model"),
        "--redis-url",
        redis_server.url,
        "--run",
        "badset",
        "--tasks",
        str(path),
    ]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    errors = [line for line in done.stderr.splitlines() if " ERROR " in line]
    assert len(errors) == 1  # one line; the model (a missing path) was never loaded
    assert f"stopped before issuing a task: {path}:2: bad env_spec 'codegym'" in errors[0]
    assert "accepted kwargs: env (required)" in errors[0]
    redis = Redis.from_url(redis_server.url)
    try:
        assert redis.keys("*") == []  # nothing issued, nothing touched
    finally:
        redis.close()


def test_curriculum_moves_by_success_rate_and_state_round_trips() -> None:
    rows = [TaskRow("easy", 0), TaskRow("hard", 1)]
    rules = CurriculumRules(
        curriculum=True, curriculum_window=4, promote_above=0.75, demote_below=0.25
    )
    sampler = TaskSampler(rows, seed=0, rules=rules)
    assert {sampler.draw()[0].env_spec for _ in range(20)} == {"easy"}
    sampler.observe([1.0, 1.0, 1.0, 0.0])  # 75% success: promote
    assert sampler.level == 1
    assert {sampler.draw()[0].env_spec for _ in range(20)} == {"hard"}
    state = json.loads(json.dumps(sampler.state()))
    copy = TaskSampler(rows, seed=99, rules=rules)
    copy.restore(state)
    assert [copy.draw() for _ in range(5)] == [sampler.draw() for _ in range(5)]
    sampler.observe([0.0, 0.0, 0.0, 0.0])  # 0% success: demote
    assert sampler.level == 0


def test_horizon_schedule() -> None:
    h = HorizonSchedule(horizon_start=2, horizon_max=4, horizon_every=10)
    assert [h.at(s) for s in (0, 9, 10, 25, 100)] == [2, 2, 3, 4, 4]
    assert HorizonSchedule().at(50) is None


async def test_in_flight_without_a_lag_counts_past_the_last_delivery_over_pages(
    redis_server: RedisServer,
) -> None:
    redis = await connect(RedisSettings.from_url(redis_server.url))
    keys = RunKeys("lagless")
    try:
        for i in range(150):  # more than two pages of the count
            await redis.xadd(keys.tasks, {b"i": str(i).encode()})
        await redis.xgroup_create(keys.tasks, "workers", id="0")
        await redis.xreadgroup("workers", "w", {keys.tasks: ">"}, count=10)
        tail = [e for e, _ in await redis.xrange(keys.tasks)][-1]
        await redis.xdel(keys.tasks, tail)
        assert (await redis.xinfo_groups(keys.tasks))[0]["lag"] is None
        # 10 pending + 139 undelivered; no trajectories stream yet
        assert await count_in_flight(redis, keys, "workers", "learner") == 149
    finally:
        await redis.aclose()


async def test_feeder_issues_only_inside_the_budget(redis_server: RedisServer) -> None:
    redis = await connect(RedisSettings.from_url(redis_server.url))
    keys = RunKeys("feed")
    sampler = TaskSampler([TaskRow("toy@{}", 0)], seed=0, rules=CurriculumRules())
    feeder = TaskFeeder(redis, keys, sampler, HorizonSchedule(3, 5, 1), group_size=4, limit=6)
    try:
        await feeder.start(await count_in_flight(redis, keys, "workers", "learner"))
        first = await feeder.top_up(buffered=2, version=0, step=0)
        assert len(first) == 4  # 6 - 2 buffered
        second = await feeder.top_up(buffered=0, version=0, step=1)
        assert len(second) == 2  # the two the reserve held back
        assert await redis.xlen(keys.tasks) == 6
        assert await feeder.top_up(buffered=0, version=0, step=2) == []
        assert {t.max_turns for t in first} == {3} and {t.group_size for t in first} == {4}
        # a restarted learner re-counts what is in flight from the streams
        assert await count_in_flight(redis, keys, "workers", "learner") == 6
        # ... also where Redis cannot tell the group's lag: 2 pending, 3 of 4 left undelivered
        await redis.xgroup_create(keys.tasks, "workers", id="0")
        await redis.xreadgroup("workers", "w", {keys.tasks: ">"}, count=2)
        undelivered = [e for e, _ in await redis.xrange(keys.tasks)][2:]
        await redis.xdel(keys.tasks, undelivered[1])  # a tombstone past the last delivery
        [info] = await redis.xinfo_groups(keys.tasks)
        assert info["lag"] is None
        assert await count_in_flight(redis, keys, "workers", "learner") == 5
        await feeder.release(3)
        later = await feeder.top_up(buffered=0, version=1, step=3)
        assert len(later) == 3 and {t.max_turns for t in later} == {5}  # the horizon rides the task
    finally:
        await redis.aclose()


def test_difficulty_filter_defers_rows_whose_groups_were_all_solved_or_all_failed() -> None:
    rows = [TaskRow("a"), TaskRow("b"), TaskRow("c")]
    rules = CurriculumRules(difficulty_filter=2, difficulty_defer_steps=5)
    sampler = TaskSampler(rows, seed=0, rules=rules)
    sampler.observe_groups([(0, [1.0, 1.0]), (1, [0.0, 0.0]), (2, [1.0, 0.0])], step=1)
    assert not sampler.deferred  # one uniform group is not yet a streak
    sampler.observe_groups([(0, [1.0, 1.0]), (1, [0.0, 1.0]), (2, [1.0, 0.0])], step=2)
    assert sampler.deferred == {0: 7}  # two solved in a row; row 1's streak was broken
    assert {sampler.draw()[0].env_spec for _ in range(30)} == {"b", "c"}
    state = json.loads(json.dumps(sampler.state()))
    copy = TaskSampler(rows, seed=5, rules=rules)
    copy.restore(state)
    assert copy.deferred == {0: 7} and [copy.draw() for _ in range(4)] == [
        sampler.draw() for _ in range(4)
    ]
    sampler.observe_groups([], step=7)  # its time is up: drawn again
    assert "a" in {sampler.draw()[0].env_spec for _ in range(30)}
    everything = TaskSampler(rows[:1], seed=0, rules=rules)
    everything.observe_groups([(0, [0.0])] * 2, step=0)
    assert everything.draw()[0].env_spec == "a"  # every row deferred: draw from all


async def test_in_flight_leaves_eval_tasks_out(redis_server: RedisServer) -> None:
    """Eval tasks take no admission slot: a restarted learner must not count them."""
    redis = await connect(RedisSettings.from_url(redis_server.url))
    keys = RunKeys("evalcount")
    producer = Producer(redis)
    try:
        mark = lambda i: EvalMark("held", "r", i)  # noqa: E731
        tasks = [
            Task(f"t{i}", "toy@{}", 2, i, 0, eval=mark(i) if i % 2 else None) for i in range(6)
        ]
        await producer.publish(keys.tasks, tasks)
        await redis.xgroup_create(keys.tasks, "workers", id="0")
        await redis.xreadgroup("workers", "w", {keys.tasks: ">"}, count=3)  # t0-t2 pending
        # 3 training tasks (t0, t2 pending; t4 waiting) of 6
        assert await count_in_flight(redis, keys, "workers", "learner") == 3
    finally:
        await redis.aclose()
