"""Task source: dataset validation, curriculum, horizon, and feeding inside the budget."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from broker.connection import RedisSettings, connect
from broker.keys import RunKeys
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
        await feeder.release(3)
        later = await feeder.top_up(buffered=0, version=1, step=3)
        assert len(later) == 3 and {t.max_turns for t in later} == {5}  # the horizon rides the task
    finally:
        await redis.aclose()
