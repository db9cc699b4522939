"""Batch preparation: sequence assembly, and what happens to each kind of group."""

from __future__ import annotations

import numpy as np

from broker.messages import ErrorCategory, Trajectory, TrajectoryGroup, Turn
from learner.algorithms import Algorithm
from learner.batch import BatchRules, assemble, prepare_batch
from learner.config import StalePolicy
from learner.source import problem_with
from tests.learner.factories import make_group


def _rules(**kw: object) -> BatchRules:
    base = {"algorithm": Algorithm.GRPO, "gamma": 1.0, "max_staleness": 1,
            "stale_policy": StalePolicy.CORRECT, "skip_zero_variance": True}  # fmt: skip
    return BatchRules(**{**base, **kw})  # type: ignore[arg-type]


def test_assembly_concatenates_prompt_then_completion_per_turn() -> None:
    t1 = Turn([1, 2], [3, 4], [-0.5, -0.25], 0, 0.0, False, False)
    t2 = Turn([5], [6], [-1.0], 0, 1.0, True, False)
    ids, mask, logp, adv = assemble(Trajectory((t1, t2), "terminated"), [0.5, 2.0])
    assert ids.tolist() == [1, 2, 3, 4, 5, 6]
    assert mask.tolist() == [0, 0, 1, 1, 0, 1]
    assert logp.tolist() == [0, 0, -0.5, -0.25, 0, -1.0]
    assert adv.tolist() == [0, 0, 0.5, 0.5, 0, 2.0]


def test_first_token_never_carries_loss() -> None:
    turn = Turn([], [7, 8], [-1.0, -2.0], 0, 1.0, True, False)
    _, mask, _, _ = assemble(Trajectory((turn,), "terminated"), [1.0])
    assert mask.tolist() == [0, 1]


def test_infra_failed_zero_variance_and_stale_groups_are_counted() -> None:
    groups = [
        make_group("ok", [0.0, 1.0]),
        make_group("infra", [0.0, 1.0], error=ErrorCategory.SANDBOX),
        make_group("flat", [1.0, 1.0]),
        make_group("old", [0.0, 1.0], version=0),
    ]
    groups[0] = make_group("ok", [0.0, 1.0], version=4)
    groups[2] = make_group("flat", [1.0, 1.0], version=4)
    out = prepare_batch(groups, _rules(), version=4)
    assert out.infra_failed == ["infra"]
    assert out.zero_variance == ["flat"]
    assert out.corrected_stale == ["old"]
    assert out.trained_groups == ["ok", "old"]
    assert sorted(out.staleness) == [0, 0, 4]
    assert [s.stale for s in out.samples] == [False, False, True, True]
    dropped = prepare_batch(groups, _rules(stale_policy=StalePolicy.DROP), version=4)
    assert dropped.dropped_stale == ["old"] and dropped.trained_groups == ["ok"]
    kept = prepare_batch(groups, _rules(skip_zero_variance=False), version=4)
    assert "flat" in kept.trained_groups and kept.zero_variance == ["flat"]


def test_format_failures_are_trained_as_the_models_own() -> None:
    group = make_group("fmt", [0.0, 1.0], error=ErrorCategory.FORMAT)
    assert prepare_batch([group], _rules(), version=0).trained_groups == ["fmt"]


def test_problem_with_catches_unusable_groups() -> None:
    assert problem_with(make_group("fine", [0.0, 1.0], vocab=100), vocab_size=100) is None
    assert "vocabulary" in str(
        problem_with(make_group("big", [0.0, 1.0], vocab=300), vocab_size=100)
    )
    g = make_group("nan", [0.0, 1.0], vocab=10)
    bad_turn = Turn([1], [2], [np.nan], 0, 0.0, True, False)
    bad = TrajectoryGroup(
        "nan", g.task, (Trajectory((bad_turn,), "terminated"), g.trajectories[1]), "w"
    )
    assert problem_with(bad, vocab_size=10) == "non-finite behaviour logprob"
    short = TrajectoryGroup("short", g.task, g.trajectories[:1], "w")
    assert "group_size" in str(problem_with(short, vocab_size=10))
