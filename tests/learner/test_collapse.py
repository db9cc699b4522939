"""Collapse is visible: deterministic groups and the rollout entropy in the step log, and one
WARNING when a near-deterministic policy's reward falls (issue 46)."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import numpy as np
import pytest
import torch

from broker.messages import ErrorCategory, TrajectoryGroup
from learner.collapse import CollapseRules, CollapseWatch, batch_shape, identical
from learner.config import LearnerConfig
from learner.core import build_core, skip_record, step_record
from learner.distributed import DistContext
from tests.learner.factories import make_group


def _same_answers(group: TrajectoryGroup) -> TrajectoryGroup:
    """Every sample answering as the first one did (token for token, logprobs 0)."""
    first = group.trajectories[0].turns
    turns = tuple(dataclasses.replace(t, logprobs=np.zeros_like(t.logprobs)) for t in first)
    runs = tuple(dataclasses.replace(tr, turns=turns) for tr in group.trajectories)
    return dataclasses.replace(group, trajectories=runs)


def test_deterministic_means_identical_samples_not_equal_rewards() -> None:
    same = _same_answers(make_group("same", [1.0, 1.0, 1.0, 1.0]))
    equal_rewards = make_group("equal", [1.0, 1.0, 1.0, 1.0])  # different answers, same score
    assert identical(same) and not identical(equal_rewards)
    assert not identical(_same_answers(make_group("one", [1.0])))  # one sample says nothing
    last = same.trajectories[-1]
    longer = dataclasses.replace(last, turns=(*last.turns, last.turns[0]))
    assert not identical(dataclasses.replace(same, trajectories=(*same.trajectories[:-1], longer)))
    failed = _same_answers(make_group("failed", [1.0] * 4, error=ErrorCategory.SANDBOX))
    assert failed.infra_failed
    shape = batch_shape([same, equal_rewards, failed])
    assert shape.deterministic == 1
    # -log mu over every sampled token of the groups kept: 12 zeros and 12 of equal_rewards
    logps = np.concatenate([t.logprobs for tr in equal_rewards.trajectories for t in tr.turns])
    assert shape.rollout_entropy == pytest.approx(-logps.sum() / 24, abs=1e-6)
    assert batch_shape([failed]).rollout_entropy is None


def _feed(watch: CollapseWatch, rewards: list[float], entropy: float) -> list[bool]:
    return [watch.observe(r, entropy, step) for step, r in enumerate(rewards)]


RULES = CollapseRules(entropy=0.05, reward_drop=0.1, window=5)


def test_a_falling_reward_at_near_zero_entropy_warns_once(caplog: pytest.LogCaptureFixture) -> None:
    watch = CollapseWatch(RULES)
    with caplog.at_level(logging.INFO, logger="learner"):
        seen = _feed(watch, [1.0] * 10 + [0.6] * 10, entropy=0.01)
    assert not any(seen[:11]) and all(seen[11:])  # the window mean falls 0.16 at batch 11
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "policy collapse" in warnings[0].getMessage()
    assert "from 1.000 to" in warnings[0].getMessage()
    with caplog.at_level(logging.INFO, logger="learner"):
        _feed(watch, [0.6] * 5, entropy=0.8)  # sampling spreads out again
    assert not watch.collapsed
    assert any("collapse over" in r.getMessage() for r in caplog.records)


def test_a_policy_hovering_at_the_thresholds_warns_once(caplog: pytest.LogCaptureFixture) -> None:
    """Entropy and reward jittering around both thresholds (as in the one-hour soak): one
    WARNING, not one every few batches; it ends only once clearly recovered."""
    watch = CollapseWatch(RULES)
    rng = np.random.default_rng(0)
    with caplog.at_level(logging.INFO, logger="learner"):
        _feed(watch, [1.0] * 10, entropy=0.04)
        for step in range(200):
            watch.observe(0.9 + rng.uniform(-0.02, 0.02), 0.05 + rng.uniform(-0.01, 0.01), step)
    assert caplog.text.count("policy collapse at") == 1
    assert "collapse over" not in caplog.text
    with caplog.at_level(logging.INFO, logger="learner"):
        _feed(watch, [0.97] * 5, entropy=0.05)  # the reward is back within half the drop
    assert caplog.text.count("collapse over") == 1


def test_a_solved_task_or_an_exploring_policy_is_not_collapse(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.WARNING, logger="learner"):
        solved = _feed(CollapseWatch(RULES), [1.0] * 40, entropy=0.0)
        exploring = _feed(CollapseWatch(RULES), [1.0] * 10 + [0.3] * 10, entropy=0.7)
        # a batch with nothing sampled (every group failed) says nothing either way
        watch = CollapseWatch(RULES)
        blind = [watch.observe(0.0, None, k) for k in range(20)]
    assert not any(solved + exploring + blind)
    assert not caplog.records


def test_the_step_log_records_deterministic_groups_and_the_rollout_entropy(
    tiny_model_dir: Path,
) -> None:
    core = build_core(
        LearnerConfig.load({"model": tiny_model_dir}, environ={}),
        DistContext(),
        torch.device("cpu"),
    )
    groups = [_same_answers(make_group("d0", [1.0] * 4)), make_group("v0")]
    prepared, stats = core.train(groups, replay=False)
    assert stats is not None
    record = step_record(core, groups, prepared, stats, wait_s=0.0, push_s=0.0).as_json()
    assert record["deterministic"] == 1 and record["zero_variance"] == 1
    assert record["rollout_entropy"] == pytest.approx(batch_shape(groups).rollout_entropy)
    solved = [_same_answers(make_group("d1", [1.0] * 4))]
    prepared, stats = core.train(solved, replay=False)  # all zero variance: skipped
    assert stats is None
    skipped = skip_record(core, solved, prepared, 0.0).as_json()
    assert skipped["deterministic"] == 1 and skipped["rollout_entropy"] == 0.0
    assert skipped["reason"] == "no_samples"
