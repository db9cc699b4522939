"""Batch preparation: sequence assembly, and what happens to each kind of group."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from broker.messages import ErrorCategory, Sampling, Trajectory, TrajectoryGroup, Turn
from learner.algorithms import Algorithm
from learner.batch import BatchRules, assemble, prepare_batch, samplings_of
from learner.config import Overlong, StalePolicy
from learner.source import problem_with
from tests.learner.factories import make_group


def _rules(**kw: object) -> BatchRules:
    base = {
        "algorithm": Algorithm.GRPO,
        "gamma": 1.0,
        "max_staleness": 1,
        "stale_policy": StalePolicy.CORRECT,
        "skip_zero_variance": True,
    }
    return BatchRules(**{**base, **kw})  # type: ignore[arg-type]


def test_assembly_concatenates_prompt_then_completion_per_turn() -> None:
    t1 = Turn([1, 2], [3, 4], [-0.5, -0.25], 0, 0.0, False, False)
    t2 = Turn([5], [6], [-1.0], 0, 1.0, True, False, sampling=Sampling(0.5, top_k=4))
    trajectory = Trajectory((t1, t2), "terminated")
    ids, mask, logp, adv, dist, turn = assemble(trajectory, [0.5, 2.0])
    assert ids.tolist() == [1, 2, 3, 4, 5, 6]
    assert mask.tolist() == [0, 0, 1, 1, 0, 1]
    assert logp.tolist() == [0, 0, -0.5, -0.25, 0, -1.0]
    assert adv.tolist() == [0, 0, 0.5, 0.5, 0, 2.0]
    # each completion token points at its turn's distribution; prompt tokens at none (-1)
    assert samplings_of(trajectory) == ((Sampling(), Sampling(0.5, top_k=4)), [0, 1])
    assert dist.tolist() == [-1, -1, 0, 0, -1, 1]
    assert turn.tolist() == [-1, -1, 0, 0, -1, 1]


def test_first_token_never_carries_loss() -> None:
    turn = Turn([], [7, 8], [-1.0, -2.0], 0, 1.0, True, False)
    _, mask, _, _, _, _ = assemble(Trajectory((turn,), "terminated"), [1.0])
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


def _episode(
    rewards: list[float],
    finish: str = "terminated",
    tokens: int = 2,
    truncation: str | None = None,
    cut: bool = False,
) -> Trajectory:
    turns = tuple(
        Turn([1], [2] * tokens, [-1.0] * tokens, 0, r, False, False, cut=cut) for r in rewards
    )
    return Trajectory(turns, finish, truncation=truncation)  # type: ignore[arg-type]


def _group(group_id: str, episodes: list[Trajectory], version: int = 0) -> TrajectoryGroup:
    g = make_group(group_id, [0.0] * len(episodes), version=version)
    episodes = [dataclasses.replace(e, sample_index=i) for i, e in enumerate(episodes)]
    return TrajectoryGroup(group_id, g.task, tuple(episodes), "w")


def test_defect_b_a_timeout_before_the_first_action_is_not_the_models_failure() -> None:
    # [hung, 1, 1, 1] used to train with A = (1 - 0.75)/0.433 = 0.577 for the three others.
    hung = Trajectory((), "error", error=ErrorCategory.TIMEOUT)
    group = _group("hung", [hung, _episode([1.0]), _episode([1.0]), _episode([1.0])])
    out = prepare_batch([group], _rules(), version=0)
    assert out.no_action_timeouts == ["hung"] and out.trained_groups == []
    assert out.infra_failed == [] and out.episode_returns == []  # not in any baseline
    # a timeout after an action is the model's (it ran out of time), and it is trained
    slow = Trajectory(_episode([0.0]).turns, "error", error=ErrorCategory.TIMEOUT)
    late = _group("late", [slow, _episode([1.0])])
    assert prepare_batch([late], _rules(), version=0).trained_groups == ["late"]


def test_groups_from_weights_discarded_by_a_resume_are_stale() -> None:
    # resumed at step 3, but the group was sampled by version 5 of the crashed run
    group = make_group("ahead", [0.0, 1.0], version=5)
    out = prepare_batch([group], _rules(), version=3)
    assert out.corrected_stale == ["ahead"] and out.staleness == [-2]
    assert all(s.stale for s in out.samples)
    assert prepare_batch(
        [group], _rules(stale_policy=StalePolicy.DROP), version=3
    ).dropped_stale == ["ahead"]


def test_defect_a_reinforce_trains_groups_of_one_and_equal_returns() -> None:
    groups = [make_group("one", [1.0]), make_group("same", [1.0, 1.0])]
    out = prepare_batch(groups, _rules(algorithm=Algorithm.REINFORCE), version=0)
    assert out.zero_variance == [] and out.trained_groups == ["one", "same"]
    assert len(out.samples) == 3


def test_overlong_mask_and_soft_punishment() -> None:
    long = _episode([1.0], "truncated", tokens=6, truncation="context")
    group = _group("long", [long, _episode([1.0], tokens=3), _episode([0.0], tokens=5)])
    plain = prepare_batch([group], _rules(skip_zero_variance=False), version=0)
    assert plain.overlong == 1 and len(plain.samples) == 3
    masked = prepare_batch([group], _rules(overlong=Overlong.MASK), version=0)
    # overlong filtering: no loss on it, but its return stays in the baseline (mean 2/3)
    assert [s.episode for s in masked.samples] == [1, 2]
    np.testing.assert_allclose(
        masked.samples[0].advantages[-1], (1 - 2 / 3) / np.std([1, 1, 0]), rtol=1e-5
    )
    soft = prepare_batch(
        [group],
        _rules(
            overlong=Overlong.SOFT, overlong_max_tokens=6, overlong_buffer=2, overlong_penalty=1.0
        ),
        version=0,
    )
    # truncated by the context: -1 -> 0; 3 tokens <= 6 - 2: 1; 5 tokens: -(5 - 4)/2 -> -0.5
    assert [float(s.turn_rewards[0]) for s in soft.samples] == [0.0, 1.0, -0.5]


def test_kl_reward_penalty_is_subtracted_from_each_turn() -> None:
    group = _group("kl", [_episode([0.0, 1.0]), _episode([1.0, 0.0])])
    rules = _rules(algorithm=Algorithm.REINFORCE, gamma=0.5)
    # per turn, the penalty on each of its two completion tokens
    penalties = {
        ("kl", 0): {0: np.array([0.125, 0.125]), 1: np.array([0.0, 0.5])},
        ("kl", 1): {1: np.array([0.125, 0.0])},
    }
    out = prepare_batch([group], rules, version=0, penalties=penalties)
    # episode 0: rewards [-0.25, 0.5]: G = [-0.25 + 0.5*0.5, 0.5] = [0, 0.5]
    # episode 1: rewards [1, -0.125]:  G = [1 - 0.0625, -0.125]
    firsts = [s.advantages[s.turn_index == k][0] for s in out.samples for k in (0, 1)]
    assert firsts == pytest.approx([0.0, 0.5, 0.9375, -0.125])
    # a token's return counts only the penalties from it on
    seconds = [s.advantages[s.turn_index == k][1] for s in out.samples for k in (0, 1)]
    assert seconds == pytest.approx([0.125, 0.5, 0.9375, 0.0])


@pytest.mark.parametrize("how", ["max-tokens", "token-budget"])
def test_defect_d3_a_length_cut_completion_is_overlong(how: str) -> None:
    # a single-turn completion that stopped at --max-tokens (finish_reason "length"), or an
    # agent whose token budget ran out: both were trained as if they had ended on their own
    cut = (
        _episode([1.0], cut=True)
        if how == "max-tokens"
        else _episode([1.0], "truncated", truncation="tokens")
    )
    group = _group("cut", [cut, _episode([1.0]), _episode([0.0])])
    masked = prepare_batch([group], _rules(overlong=Overlong.MASK), version=0)
    assert masked.overlong == 1 and [s.episode for s in masked.samples] == [1, 2]
