"""The learner's maths against hand-computed numbers."""

from __future__ import annotations

import math

import numpy as np
import pytest

from broker.messages import Task, Trajectory, TrajectoryGroup, Turn
from learner.algorithms import (
    AdvantageRules,
    Advantages,
    Algorithm,
    compute_advantages,
    discounted_returns,
    episode_return,
    gae,
    overlong_penalty,
)
from learner.batch import BatchRules, prepare_batch
from learner.config import GroupStd
from learner.critic import episode_gae, token_rewards


def _adv(rewards: list, algorithm: Algorithm, gamma: float = 1.0, **kw: object) -> Advantages:
    return compute_advantages(rewards, AdvantageRules(algorithm, gamma, **kw))  # type: ignore[arg-type]


def test_discounted_returns_by_hand() -> None:
    # G2 = 2; G1 = 0 + 0.5*2 = 1; G0 = 1 + 0.5*1 = 1.5
    assert discounted_returns([1.0, 0.0, 2.0], 0.5).tolist() == [1.5, 1.0, 2.0]
    assert discounted_returns([1.0, 0.0, 2.0], 1.0).tolist() == [3.0, 2.0, 2.0]
    assert discounted_returns([1.0, 5.0], 0.0).tolist() == [1.0, 5.0]
    assert episode_return([], 0.9) == 0.0


def test_grpo_group_normalisation() -> None:
    adv = _adv([[[0.0], [1.0], [2.0]]], Algorithm.GRPO, 1.0)
    # mean 1, population std sqrt(2/3): +/-1/sqrt(2/3) = +/-1.224744...
    expected = [-1.0 / math.sqrt(2 / 3), 0.0, 1.0 / math.sqrt(2 / 3)]
    got = [a[0] for a in adv.values[0]]
    np.testing.assert_allclose(got, expected, rtol=1e-5)
    assert adv.zero_variance == [False]


def test_grpo_uses_discounted_episode_return_on_every_turn() -> None:
    # episode returns with gamma=0.5: [1, 1] -> 1.5 ; [0, 0] -> 0 ; advantages +/-1 (pop std 0.75)
    adv = _adv([[[1.0, 1.0], [0.0, 0.0]]], Algorithm.GRPO, 0.5)
    np.testing.assert_allclose(adv.values[0][0], [1.0, 1.0], rtol=1e-5)
    np.testing.assert_allclose(adv.values[0][1], [-1.0, -1.0], rtol=1e-5)


def test_rloo_leave_one_out() -> None:
    adv = _adv([[[0.0], [1.0], [2.0]]], Algorithm.RLOO, 1.0)
    assert [float(a[0]) for a in adv.values[0]] == [-1.5, 0.0, 1.5]


def test_reinforce_is_the_per_turn_return() -> None:
    adv = _adv([[[1.0, 0.0, 2.0], [0.0]]], Algorithm.REINFORCE, 0.5)
    assert adv.values[0][0].tolist() == [1.5, 1.0, 2.0]
    assert adv.values[0][1].tolist() == [0.0]


def test_rebn_normalises_per_turn_returns_over_the_batch() -> None:
    # GEM's ReBN: per-turn returns of the whole batch, (G - mean) / std.
    # returns: group 1 -> [2, 1] and [0]; group 2 -> [3] and [1]; flat [2, 1, 0, 3, 1]
    rewards: list = [[[1.0, 1.0], [0.0]], [[3.0], [1.0]]]
    adv = _adv(rewards, Algorithm.REBN, 1.0)
    std = math.sqrt(1.04)  # mean 1.4, population variance 5.2 / 5
    np.testing.assert_allclose(adv.values[0][0], [0.6 / std, -0.4 / std], rtol=1e-5)
    np.testing.assert_allclose(adv.values[0][1], [-1.4 / std], rtol=1e-5)
    np.testing.assert_allclose(adv.values[1][0], [1.6 / std], rtol=1e-5)
    np.testing.assert_allclose(adv.values[1][1], [-0.4 / std], rtol=1e-5)


def test_zero_variance_is_flagged_only_for_group_relative_estimators() -> None:
    # Defect A: equal returns leave no signal only where the baseline is the group's mean.
    for algorithm in Algorithm:
        adv = _adv([[[1.0], [1.0]], [[0.0], [1.0]]], algorithm, 1.0)
        relative = algorithm in (Algorithm.GRPO, Algorithm.RLOO, Algorithm.REINFORCE_PP_BASELINE)
        assert adv.zero_variance == [relative, False], algorithm
    # REINFORCE with group size 1, natural for it, keeps its signal: A = G = 1.
    single = _adv([[[1.0]], [[0.5]]], Algorithm.REINFORCE)
    assert single.zero_variance == [False, False]
    assert [float(g[0][0]) for g in single.values] == [1.0, 0.5]
    grpo = _adv([[[1.0], [1.0]]], Algorithm.GRPO, 1.0)
    assert [float(a[0]) for a in grpo.values[0]] == [0.0, 0.0]


def test_grpo_std_choices_and_the_switch_off() -> None:
    # returns [0, 0, 3]: mean 1, centred [-1, -1, 2]; squared deviations sum to 6
    rewards = [[[0.0], [0.0], [3.0]]]
    pop = [float(a[0]) for a in _adv(rewards, Algorithm.GRPO).values[0]]
    np.testing.assert_allclose(pop, np.array([-1, -1, 2]) / math.sqrt(6 / 3), rtol=1e-5)
    unbiased = _adv(rewards, Algorithm.GRPO, std=GroupStd.UNBIASED).values[0]
    np.testing.assert_allclose(
        [float(a[0]) for a in unbiased], np.array([-1, -1, 2]) / math.sqrt(6 / 2), rtol=1e-5
    )
    centred = _adv(rewards, Algorithm.GRPO, scale_by_std=False).values[0]
    assert [float(a[0]) for a in centred] == [-1.0, -1.0, 2.0]
    # one episode: no spread to divide by; advantage 0, not NaN
    assert float(_adv([[[1.0]]], Algorithm.GRPO, std=GroupStd.UNBIASED).values[0][0][0]) == 0.0


def test_soft_overlong_penalty_by_hand() -> None:
    # L_max 10, buffer 4: free up to 6 tokens, then -(L - 6)/4, and -1 from 10 on
    assert overlong_penalty(6, 10, 4, 1.0) == 0.0
    assert overlong_penalty(8, 10, 4, 1.0) == -0.5
    assert overlong_penalty(10, 10, 4, 1.0) == -1.0
    assert overlong_penalty(15, 10, 4, 1.0) == -1.0
    assert overlong_penalty(9, 10, 4, 0.5) == pytest.approx(-0.375)


def test_gae_across_three_turns_by_hand() -> None:
    # A 3-turn episode in input coordinates: prompt tokens (mask 0) precede each turn's
    # completion tokens (mask 1); each turn's reward sits on its last completion token.
    #   index   0    1    2    3    4    5    6    7    8
    #   mask    0    0    1    1    0    1    0    1    1
    #   reward            0   .5         0         0    1
    #   value   0    0   .2   .4    9   .3    9   .6   .8   (9s on prompt tokens are skipped)
    mask = np.array([0, 0, 1, 1, 0, 1, 0, 1, 1], np.float32)
    rewards = np.array([0, 0, 0, 0.5, 0, 0, 0, 0, 1.0])
    values = np.array([0, 0, 0.2, 0.4, 9, 0.3, 9, 0.6, 0.8])
    gamma, lam = 0.9, 0.8
    # delta_t = r_t + gamma V_next - V_t ; A_t = delta_t + gamma lam A_next (gamma lam = 0.72)
    a8 = 1.0 + 0.9 * 0.0 - 0.8  # 0.2, last token: V_next = 0
    a7 = (0.0 + 0.9 * 0.8 - 0.6) + 0.72 * a8  # 0.12 + 0.144 = 0.264
    a5 = (0.0 + 0.9 * 0.6 - 0.3) + 0.72 * a7  # next masked-in token is 7, not prompt 6
    a3 = (0.5 + 0.9 * 0.3 - 0.4) + 0.72 * a5  # crosses the prompt token 4
    a2 = (0.0 + 0.9 * 0.4 - 0.2) + 0.72 * a3
    adv, ret = gae(rewards, values, mask, gamma, lam)
    expected = np.array([0, 0, a2, a3, 0, a5, 0, a7, a8])
    np.testing.assert_allclose(adv, expected, atol=1e-12)
    np.testing.assert_allclose(adv[[2, 3, 5, 7, 8]], [0.649353472, 0.6796576, 0.43008, 0.264, 0.2])
    np.testing.assert_allclose(ret, np.where(mask > 0, expected + values, 0.0), atol=1e-12)
    # gamma = lam = 1: A_t is the sum of the rewards still to come minus V_t (Monte Carlo)
    mc, _ = gae(rewards, values, mask, 1.0, 1.0)
    np.testing.assert_allclose(
        mc[[2, 3, 5, 7, 8]], [1.5 - 0.2, 1.5 - 0.4, 1 - 0.3, 1 - 0.6, 1 - 0.8]
    )


def test_reinforce_pp_whitens_returns_over_the_batchs_tokens() -> None:
    # two groups of one-turn episodes; returns [1, 0] and [1]; tokens [3, 1] and [4]
    rewards = [[[1.0], [0.0]], [[1.0]]]
    tokens = [[np.array([3]), np.array([1])], [np.array([4])]]
    out = compute_advantages(rewards, AdvantageRules(Algorithm.REINFORCE_PP, 1.0), tokens)
    # token-weighted: mean = 7/8, var = (7 * (1/8)^2 + (7/8)^2) / 8 = 7/64, std = 0.3307
    std = math.sqrt(7 / 64)
    got = [float(t[0]) for g in out.values for t in g]
    assert got == pytest.approx([(1 - 7 / 8) / std, (0 - 7 / 8) / std, (1 - 7 / 8) / std], rel=1e-5)
    # reinforce++-baseline subtracts each group's mean return first: [0.5, -0.5] and [0],
    # then whitens with the token weights: mean = (1.5 - 0.5) / 8 = 1/8
    base = compute_advantages(rewards, AdvantageRules(Algorithm.REINFORCE_PP_BASELINE, 1.0), tokens)
    centred = np.array([0.5, -0.5, 0.0])
    w = np.array([3.0, 1.0, 4.0])
    mean = np.average(centred, weights=w)
    sd = math.sqrt(np.average((centred - mean) ** 2, weights=w))
    got = [float(t[0]) for g in base.values for t in g]
    assert got == pytest.approx(list((centred - mean) / sd), rel=1e-5)
    assert mean == pytest.approx(1 / 8)


def test_gae_bootstraps_a_truncated_episode_by_hand() -> None:
    # the three-turn episode above, cut by a limit after its last token: V_next there is the
    # value of the state after it (0.5), not 0
    mask = np.array([0, 0, 1, 1, 0, 1, 0, 1, 1], np.float32)
    rewards = np.array([0, 0, 0, 0.5, 0, 0, 0, 0, 1.0])
    values = np.array([0, 0, 0.2, 0.4, 9, 0.3, 9, 0.6, 0.8])
    a8 = 1.0 + 0.9 * 0.5 - 0.8  # 0.65 (0.2 when terminated)
    a7 = (0.0 + 0.9 * 0.8 - 0.6) + 0.72 * a8
    adv, ret = gae(rewards, values, mask, 0.9, 0.8, bootstrap=0.5)
    np.testing.assert_allclose(adv[[7, 8]], [a7, a8], atol=1e-12)
    np.testing.assert_allclose(ret[8], a8 + 0.8, atol=1e-12)
    terminated, _ = gae(rewards, values, mask, 0.9, 0.8)
    assert terminated[8] == pytest.approx(0.2)


def _two_segments(finish: str, truncation: str | None = None) -> TrajectoryGroup:
    """Two turns, the second a new segment (an agent rewrote its history), reward 1 at the end."""
    turns = (
        Turn([1, 2], [3, 4], [-1.0, -1.0], 0, 0.0, False, False),
        Turn([5], [6, 7], [-1.0, -1.0], 0, 1.0, finish == "terminated", False, segment_start=True),
    )
    task = Task("d2", "toy@{}", 1, 0, 0, 0.0)
    trajectory = Trajectory(turns, finish, truncation=truncation)  # type: ignore[arg-type]
    return TrajectoryGroup("d2", task, (trajectory,), "w")


@pytest.mark.parametrize(
    ("finish", "truncation", "after"), [("terminated", None, 0.0), ("truncated", "max_turns", 0.5)]
)
def test_defect_d2_gae_runs_across_the_segments_of_an_episode(
    finish: str, truncation: str | None, after: float
) -> None:
    # gamma 0.9, lambda 0.8 (gamma lambda = 0.72) and values that differ per token, with 9 on
    # the prompt tokens, which GAE must skip. Joined, the episode is
    #   position   0   1   2   3   4 | 0   1   2        (segment 1 | segment 2)
    #   mask       0   0   1   1     | 0   1   1
    #   value      9   9  .2  .4     | 9  .3  .6        and V after the last token = 0.5
    #   reward                 0     |         1
    # A truncated episode bootstraps from 0.5 after its last token; a terminated one from 0.
    rules = BatchRules(Algorithm.PPO, 1.0, max_staleness=1, skip_zero_variance=False)
    samples = prepare_batch([_two_segments(finish, truncation)], rules, version=0).samples
    assert len(samples) == 2  # two sequences, one per segment
    assert [s.bootstrap for s in samples] == [False, truncation is not None]
    values = [np.array([9, 9, 0.2, 0.4]), np.array([9, 0.3, 0.6])]
    a6 = 1.0 + 0.9 * after - 0.6
    a5 = (0.0 + 0.9 * 0.6 - 0.3) + 0.72 * a6
    a3 = (0.0 + 0.9 * 0.3 - 0.4) + 0.72 * a5  # the next trained token is segment 2's first
    a2 = (0.0 + 0.9 * 0.4 - 0.2) + 0.72 * a3
    (adv1, ret1), (adv2, ret2) = episode_gae(samples, values, [9.0, 0.5], 0.9, 0.8)
    np.testing.assert_allclose(adv1, [0, 0, a2, a3], atol=1e-12)
    np.testing.assert_allclose(adv2, [0, a5, a6], atol=1e-12)
    np.testing.assert_allclose(ret1[2:], [a2 + 0.2, a3 + 0.4], atol=1e-12)
    np.testing.assert_allclose(ret2[1:], [a5 + 0.3, a6 + 0.6], atol=1e-12)


def _turn(prompt: list[int], completion: list[int], reward: float, **kw: bool) -> Turn:
    return Turn(prompt, completion, [-1.0] * len(completion), 0, reward, False, False, **kw)


def test_a_turns_reward_is_kept_when_the_turn_has_no_completion_token() -> None:
    # Turn 2 samples nothing (or sits in a segment that trains nothing): its reward follows
    # turn 1's action, so it lands on turn 1's last completion token instead of vanishing.
    rules = BatchRules(Algorithm.PPO, 1.0, max_staleness=1, skip_zero_variance=False)
    task = Task("empty", "toy@{}", 1, 0, 0, 0.0)
    for second in (_turn([5], [], 1.0), _turn([5, 6], [], 1.0, segment_start=True)):
        turns = (_turn([1, 2], [3, 4], 0.5), second, _turn([8], [9], 2.0))
        group = TrajectoryGroup("empty", task, (Trajectory(turns, "terminated"),), "w")
        samples = prepare_batch([group], rules, version=0).samples
        rewards = token_rewards(samples)
        on = np.concatenate([s.loss_mask for s in samples]) > 0
        assert rewards[on].tolist() == [0.0, 1.5, 2.0]
        assert rewards.sum() == 3.5
    # a reward with no completion token before it precedes every trained token: no return
    # counts it (it is not the consequence of any action in the sequence)
    first = (_turn([1, 2], [], 1.0), _turn([3], [4, 5], 0.5))
    group = TrajectoryGroup("empty", task, (Trajectory(first, "terminated"),), "w")
    assert token_rewards(prepare_batch([group], rules, version=0).samples).tolist() == [
        0,
        0,
        0,
        0,
        0.5,
    ]


def _penalised_group() -> tuple[TrajectoryGroup, dict]:
    """Two one-turn episodes of three completion tokens; a per-token KL penalty on each."""
    task = Task("kl", "toy@{}", 2, 0, 0, 0.0)
    episodes = (
        Trajectory((_turn([1, 2], [3, 4, 5], 1.0),), "terminated", sample_index=0),
        Trajectory((_turn([1, 2], [6, 7, 8], 0.0),), "terminated", sample_index=1),
    )
    penalties = {("kl", 0): {0: np.array([0.1, 0.2, 0.3])}, ("kl", 1): {0: np.array([0, 0, 0.6])}}
    return TrajectoryGroup("kl", task, episodes, "w"), penalties


@pytest.mark.parametrize(
    ("algorithm", "expected"),
    [
        # returns: episode 0 G = 1 - 0.6 = 0.4, its token j counts the penalties from j on:
        # [0.4, 0.5, 0.7]; episode 1 [-0.6, -0.6, -0.6] (its one penalty is on its last token)
        (Algorithm.REINFORCE, [[0.4, 0.5, 0.7], [-0.6, -0.6, -0.6]]),
        # rebn: the batch's turn returns [0.4, -0.6] have mean -0.1 and std 0.5
        (Algorithm.REBN, [[1.0, 1.2, 1.6], [-1.0, -1.0, -1.0]]),
        # grpo: the episode's whole return, on every token (verl sums a token-level reward)
        (Algorithm.GRPO, [[1.0, 1.0, 1.0], [-1.0, -1.0, -1.0]]),
    ],
)
def test_a_kl_reward_is_per_token(algorithm: Algorithm, expected: list) -> None:
    group, penalties = _penalised_group()
    rules = BatchRules(algorithm, 1.0, max_staleness=1, skip_zero_variance=False)
    samples = prepare_batch([group], rules, 0, penalties).samples
    got = [s.advantages[s.loss_mask > 0].tolist() for s in samples]
    np.testing.assert_allclose(got, expected, rtol=1e-5)


def test_reinforce_pp_whitens_token_returns_of_a_kl_reward() -> None:
    group, penalties = _penalised_group()
    rules = BatchRules(Algorithm.REINFORCE_PP, 1.0, max_staleness=1, skip_zero_variance=False)
    samples = prepare_batch([group], rules, 0, penalties).samples
    returns = np.array([0.4, 0.5, 0.7, -0.6, -0.6, -0.6])  # per token, as for reinforce
    mean = returns.sum() / 6  # -0.2 / 6
    std = math.sqrt(((returns - mean) ** 2).sum() / 6)
    got = np.concatenate([s.advantages[s.loss_mask > 0] for s in samples])
    np.testing.assert_allclose(got, (returns - mean) / std, rtol=1e-5)


def test_the_critic_sees_a_kl_reward_on_every_token() -> None:
    group, penalties = _penalised_group()
    rules = BatchRules(Algorithm.PPO, 1.0, max_staleness=1, skip_zero_variance=False)
    first, second = prepare_batch([group], rules, 0, penalties).samples
    assert token_rewards([first]).tolist() == pytest.approx([0, 0, -0.1, -0.2, 1.0 - 0.3])
    assert token_rewards([second]).tolist() == pytest.approx([0, 0, 0, 0, -0.6])
    # V = 0, gamma = lambda = 1: a token's return is the reward from it on
    (_, ret), _ = episode_gae([first, second], [np.zeros(5)] * 2, [0.0, 0.0], 1.0, 1.0)
    assert ret[2:].tolist() == pytest.approx([0.4, 0.5, 0.7])


def test_a_kl_penalty_on_a_sequences_first_token_is_left_out() -> None:
    # a segment whose first token is a completion token: nothing scores position 0, so the
    # reference's array covers the turn's last tokens only; the first gets no penalty
    task = Task("p0", "toy@{}", 1, 0, 0, 0.0)
    turns = (_turn([1], [2], 0.0), _turn([], [3, 4, 5], 1.0, segment_start=True))
    group = TrajectoryGroup("p0", task, (Trajectory(turns, "terminated"),), "w")
    penalties = {("p0", 0): {1: np.array([0.2, 0.3])}}
    rules = BatchRules(Algorithm.REINFORCE, 1.0, max_staleness=1, skip_zero_variance=False)
    samples = prepare_batch([group], rules, 0, penalties).samples
    # G_1 = 1 - 0.5; token returns [0.5, 0.5, 0.7]; turn 0's return is G_1 too (reward 0)
    assert samples[1].advantages.tolist() == pytest.approx([0.5, 0.5, 0.7])
    assert samples[1].token_penalty.tolist() == pytest.approx([0, 0.2, 0.3])
