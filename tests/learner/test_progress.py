"""Zero variance is loud (issue 42): what a skipped batch's groups scored reaches the record,
the metrics and the trackers; batch after batch with nothing to train logs one WARNING naming
the cause and the remedies; a solved run stops with --stop-when-solved."""

from __future__ import annotations

import dataclasses
import logging

import pytest
from prometheus_client import REGISTRY

from learner.batch import prepare_batch
from learner.config import BatchRules, LearnerConfig
from learner.progress import IdleWatch, Progress, ProgressRules, SolvedWatch
from learner.record import SkipRecord, StepRecord, emit_skip
from learner.tracking.base import Tracker
from learner.tracking.config import TrackingConfig
from tests.learner.factories import make_group


def skipped(groups: int = 4, zero_variance: int = 4, reward: float | None = 1.0) -> SkipRecord:
    return SkipRecord(
        reason="no_samples",
        step=7,
        version=7,
        groups=groups,
        reward_mean=reward if reward is not None else 0.0,
        zero_variance=zero_variance,
        zero_variance_reward=reward if zero_variance else None,
        deterministic=0,
        rollout_entropy=0.5,
        infra_failed=groups - zero_variance,
        no_action_timeouts=0,
        stale_dropped=0,
        wait_s=0.1,
    )


def trained(reward: float = 0.5, step: int = 8) -> StepRecord:
    zeros = {f.name: 0 for f in dataclasses.fields(StepRecord) if f.default is dataclasses.MISSING}
    fields = {**zeros, "step": step, "groups": 4, "reward_mean": reward}
    return StepRecord(**fields)  # type: ignore[arg-type]


def test_a_skipped_batch_records_its_zero_variance_groups_common_reward() -> None:
    groups = [
        make_group("solved", [1.0, 1.0, 1.0, 1.0]),
        make_group("hard", [0.0, 0.0, 0.0, 0.0]),
        make_group("solved2", [1.0, 1.0, 1.0, 1.0]),
    ]
    prepared = prepare_batch(groups, BatchRules(), version=0)
    assert prepared.zero_variance_returns == [1.0, 0.0, 1.0]
    record = SkipRecord.measure(0, 0, len(groups), prepared, wait_s=0.0)
    assert record.zero_variance == 3
    assert record.zero_variance_reward == pytest.approx(2 / 3)
    assert record.as_json()["zero_variance_reward"] == pytest.approx(2 / 3)

    def value(name: str) -> float:
        return REGISTRY.get_sample_value(name) or 0.0

    before = {
        n: value(n)
        for n in ("farm_learner_groups_total", "farm_learner_zero_variance_reward_total")
    }
    emit_skip(record, prepared)
    assert value("farm_learner_groups_total") - before["farm_learner_groups_total"] == 3
    gained = value("farm_learner_zero_variance_reward_total")
    assert gained - before["farm_learner_zero_variance_reward_total"] == pytest.approx(2.0)


class Recorder:
    name = "recorder"

    def __init__(self) -> None:
        self.logged: list[tuple[int, dict[str, float]]] = []

    def log_scalars(self, step: int, scalars: dict[str, float]) -> None:
        self.logged.append((step, dict(scalars)))

    def log_samples(self, table: object) -> None: ...

    def close(self) -> None: ...


def test_trackers_get_the_skipped_groups_reward() -> None:
    backend = Recorder()
    tracker = Tracker([backend], TrackingConfig(), lambda: lambda ids: "")
    tracker.skip(skipped(reward=1.0))
    tracker.skip(skipped(zero_variance=0, reward=None))
    assert backend.logged[0] == (
        7,
        {
            "batch/skipped_batches": 1.0,
            "batch/skipped_reward_mean": 1.0,
            "batch/skipped_zero_variance": 4.0,
            "batch/skipped_zero_variance_reward": 1.0,
        },
    )
    assert "batch/skipped_zero_variance_reward" not in backend.logged[1][1]


def warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


def test_batches_with_nothing_to_train_warn_naming_cause_and_remedies(
    caplog: pytest.LogCaptureFixture,
) -> None:
    watch = IdleWatch(limit=3)
    with caplog.at_level(logging.INFO, logger="learner"):
        for _ in range(2):
            watch.observe(skipped(reward=1.0), False)
        assert warnings(caplog) == []
        watch.observe(skipped(reward=1.0), False)
    (message,) = warnings(caplog)
    assert message.startswith("3 batches in a row trained nothing (still at step 7)")
    assert "12 of 12 groups had zero variance (all 1.0: solved)" in message
    for remedy in ("--dynamic-sampling", "--difficulty-filter", "harder tasks", "easier ones"):
        assert remedy in message
    with caplog.at_level(logging.INFO, logger="learner"):
        for _ in range(3):  # batches 4-6: the next WARNING comes at twice the streak
            watch.observe(skipped(reward=1.0), False)
    assert len(warnings(caplog)) == 2 and warnings(caplog)[1].startswith("6 batches")
    with caplog.at_level(logging.INFO, logger="learner"):
        watch.observe(trained(), True)
    assert "training again at step 8 after 6 idle batches" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="learner"):
        for _ in range(3):
            watch.observe(skipped(reward=0.0), False)
    (hard,) = warnings(caplog)
    assert hard.startswith("3 batches") and "(all 0.0: too hard)" in hard


def test_a_streak_of_infrastructure_failures_names_no_zero_variance_remedy(
    caplog: pytest.LogCaptureFixture,
) -> None:
    watch = IdleWatch(limit=1)
    with caplog.at_level(logging.WARNING, logger="learner"):
        watch.observe(skipped(zero_variance=0, reward=None), False)
    (message,) = warnings(caplog)
    assert "0 of 4 groups had zero variance, 4 failed in the infrastructure." in message
    assert "--dynamic-sampling" not in message
    quiet = IdleWatch(limit=0)
    quiet.observe(skipped(), False)
    assert quiet.warned_at == 0


def test_a_solved_run_stops_once_the_mean_has_held_for_the_window() -> None:
    rules = ProgressRules(stop_when_solved=True, solved_mean_batches=3, solved_window=2)
    progress = Progress.of(rules)
    # the 3-batch mean: -, -, 0.8, 1.0 (held 1), 1.0 (held 2: stop)
    batches = (trained(0.4), trained(1.0), skipped(), skipped(), skipped())
    seen = [progress.observe(r, isinstance(r, StepRecord)) for r in batches]
    assert seen == [False, False, False, False, True]
    watch = SolvedWatch(rules)
    reasons = [watch.observe(r) for r in (skipped(), skipped(), skipped(), trained(0.5))]
    assert reasons == [None, None, None, None]  # the dip to 0.83 restarts the window
    assert watch.held == 0
    infra = skipped(zero_variance=0, reward=None)
    assert watch.observe(infra) is None and len(watch.rewards) == 3  # scored nothing: ignored
    off = SolvedWatch(ProgressRules(solved_mean_batches=1, solved_window=1))
    assert off.observe(skipped()) is None  # only with --stop-when-solved


def test_the_solved_reason_names_the_mean_and_the_window(caplog: pytest.LogCaptureFixture) -> None:
    rules = ProgressRules(stop_when_solved=True, solved_mean_batches=2, solved_window=1)
    progress = Progress.of(rules)
    with caplog.at_level(logging.INFO, logger="learner"):
        assert not progress.observe(skipped(), False)
        assert progress.observe(skipped(), False)
    assert (
        '{"event": "solved", "step": 7, "reason": "solved: the 2-batch mean reward 1.000 '
        'stayed >= 0.95 for 1 batches (step 7)"}' in caplog.text
    )


def test_every_progress_rule_is_a_learner_flag() -> None:
    cfg = LearnerConfig.model_validate(
        {"model": "m", "progress": {"stop_when_solved": True, "solved_reward": 0.9}}
    )
    assert cfg.progress.solved_reward == 0.9 and cfg.progress.idle_warn_batches == 20
