"""The learner's maths against hand-computed numbers."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from learner.algorithms import (
    Aggregation,
    Algorithm,
    aggregate,
    compute_advantages,
    discounted_returns,
    episode_return,
    importance_ratio,
    policy_token_loss,
)


def test_discounted_returns_by_hand() -> None:
    # G2 = 2; G1 = 0 + 0.5*2 = 1; G0 = 1 + 0.5*1 = 1.5
    assert discounted_returns([1.0, 0.0, 2.0], 0.5).tolist() == [1.5, 1.0, 2.0]
    assert discounted_returns([1.0, 0.0, 2.0], 1.0).tolist() == [3.0, 2.0, 2.0]
    assert discounted_returns([1.0, 5.0], 0.0).tolist() == [1.0, 5.0]
    assert episode_return([], 0.9) == 0.0


def test_grpo_group_normalisation() -> None:
    adv = compute_advantages([[[0.0], [1.0], [2.0]]], Algorithm.GRPO, 1.0)
    # mean 1, population std sqrt(2/3): +/-1/sqrt(2/3) = +/-1.224744...
    expected = [-1.0 / math.sqrt(2 / 3), 0.0, 1.0 / math.sqrt(2 / 3)]
    got = [a[0] for a in adv.values[0]]
    np.testing.assert_allclose(got, expected, rtol=1e-5)
    assert adv.zero_variance == [False]


def test_grpo_uses_discounted_episode_return_on_every_turn() -> None:
    # episode returns with gamma=0.5: [1, 1] -> 1.5 ; [0, 0] -> 0 ; advantages +/-1 (pop std 0.75)
    adv = compute_advantages([[[1.0, 1.0], [0.0, 0.0]]], Algorithm.GRPO, 0.5)
    np.testing.assert_allclose(adv.values[0][0], [1.0, 1.0], rtol=1e-5)
    np.testing.assert_allclose(adv.values[0][1], [-1.0, -1.0], rtol=1e-5)


def test_rloo_leave_one_out() -> None:
    adv = compute_advantages([[[0.0], [1.0], [2.0]]], Algorithm.RLOO, 1.0)
    assert [float(a[0]) for a in adv.values[0]] == [-1.5, 0.0, 1.5]


def test_reinforce_is_the_per_turn_return() -> None:
    adv = compute_advantages([[[1.0, 0.0, 2.0], [0.0]]], Algorithm.REINFORCE, 0.5)
    assert adv.values[0][0].tolist() == [1.5, 1.0, 2.0]
    assert adv.values[0][1].tolist() == [0.0]


def test_rebn_normalises_per_turn_returns_over_the_batch() -> None:
    # GEM's ReBN: per-turn returns of the whole batch, (G - mean) / std.
    # returns: group 1 -> [2, 1] and [0]; group 2 -> [3] and [1]; flat [2, 1, 0, 3, 1]
    rewards = [[[1.0, 1.0], [0.0]], [[3.0], [1.0]]]
    adv = compute_advantages(rewards, Algorithm.REBN, 1.0)
    std = math.sqrt(1.04)  # mean 1.4, population variance 5.2 / 5
    np.testing.assert_allclose(adv.values[0][0], [0.6 / std, -0.4 / std], rtol=1e-5)
    np.testing.assert_allclose(adv.values[0][1], [-1.4 / std], rtol=1e-5)
    np.testing.assert_allclose(adv.values[1][0], [1.6 / std], rtol=1e-5)
    np.testing.assert_allclose(adv.values[1][1], [-0.4 / std], rtol=1e-5)


def test_zero_variance_groups_are_flagged_for_every_algorithm() -> None:
    for algorithm in Algorithm:
        adv = compute_advantages([[[1.0], [1.0]], [[0.0], [1.0]]], algorithm, 1.0)
        assert adv.zero_variance == [True, False], algorithm
    grpo = compute_advantages([[[1.0], [1.0]]], Algorithm.GRPO, 1.0)
    assert [float(a[0]) for a in grpo.values[0]] == [0.0, 0.0]


def _loss_and_grad(ratio: float, advantage: float, stale: bool = False) -> tuple[float, float]:
    logp = torch.tensor([[math.log(ratio)]], dtype=torch.float64, requires_grad=True)
    out = policy_token_loss(
        logp,
        torch.zeros(1, 1, dtype=torch.float64),
        torch.tensor([[advantage]], dtype=torch.float64),
        clip_low=0.2,
        clip_high=0.2,
        stale=torch.tensor([stale]),
        tis_cap=2.0,
    )
    out.loss.sum().backward()
    assert logp.grad is not None
    return float(out.loss.detach()), float(logp.grad)


@pytest.mark.parametrize(
    ("ratio", "advantage", "loss", "grad"),
    [
        (1.0, 1.0, -1.0, -1.0),  # on-policy: plain policy gradient, descent raises logp
        (1.0, -1.0, 1.0, 1.0),  # negative advantage: descent lowers logp
        (1.5, 1.0, -1.2, 0.0),  # above 1+eps with A>0: clipped, no gradient
        (1.5, -1.0, 1.5, 1.5),  # above 1+eps with A<0: unclipped (pessimistic), grad r*(-A)
        (0.5, 1.0, -0.5, -0.5),  # below 1-eps with A>0: unclipped
        (0.5, -1.0, 0.8, 0.0),  # below 1-eps with A<0: clipped, no gradient
    ],
)
def test_ppo_clip_values_and_gradient_signs(
    ratio: float, advantage: float, loss: float, grad: float
) -> None:
    got_loss, got_grad = _loss_and_grad(ratio, advantage)
    assert got_loss == pytest.approx(loss)
    assert got_grad == pytest.approx(grad, abs=1e-12)


def test_truncated_importance_sampling_for_stale_rows() -> None:
    # loss = -min(r, rho_bar)*A*logpi with r detached: gradient -min(r, 2)*A
    _, grad = _loss_and_grad(3.0, 1.0, stale=True)
    assert grad == pytest.approx(-2.0)
    _, grad = _loss_and_grad(0.5, -1.0, stale=True)
    assert grad == pytest.approx(0.5)


def test_importance_ratio_exactly_one_when_policies_agree() -> None:
    logp = torch.log_softmax(torch.randn(3, 7, generator=torch.Generator().manual_seed(0)), -1)
    assert torch.equal(importance_ratio(logp, logp.clone()), torch.ones_like(logp))


def test_aggregation_token_and_sequence_means() -> None:
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    token = aggregate(loss, mask, Aggregation.TOKEN_MEAN, total_tokens=4, total_sequences=2)
    assert float(token) == pytest.approx((1 + 2 + 3 + 4) / 4)
    seq = aggregate(loss, mask, Aggregation.SEQ_MEAN, total_tokens=4, total_sequences=2)
    assert float(seq) == pytest.approx((2.0 + 4.0) / 2)
    # shares of micro-batches add up to the loss of the whole batch
    first = aggregate(loss[:1], mask[:1], Aggregation.SEQ_MEAN, total_tokens=4, total_sequences=2)
    second = aggregate(loss[1:], mask[1:], Aggregation.SEQ_MEAN, total_tokens=4, total_sequences=2)
    assert float(first + second) == pytest.approx(float(seq))
