"""The loss terms against hand-computed values: decoupled PPO, KL, value loss, aggregation."""

from __future__ import annotations

import math

import pytest
import torch

from learner.config import (
    Aggregation,
    Correction,
    CorrectionLevel,
    KLEstimator,
    LearnerConfig,
    LossConfig,
    OptimConfig,
    PolicyRatio,
    loss_aggregation,
)
from learner.losses import (
    PolicyLossConfig,
    PolicyTerms,
    aggregate,
    clipped_value_loss,
    decoupled_ppo_loss,
    kl_penalty,
)

CFG = PolicyLossConfig(
    clip_low=0.2,
    clip_high=0.2,
    dual_clip=3.0,
    correction=Correction.TIS,
    cap=2.0,
    log_ratio_clamp=20.0,
)


def _one(
    ratio: float,
    weight: float,
    advantage: float,
    cfg: PolicyLossConfig = CFG,
    log_gap: float | None = None,
) -> tuple[PolicyTerms, float]:
    """One token with pi_theta/pi_prox = ratio and pi_prox/mu = weight; (terms, dloss/dlogp)."""
    prox = torch.tensor([[math.log(0.5)]], dtype=torch.float64)
    gap = math.log(ratio) if log_gap is None else log_gap
    logp = (prox + gap).clone().requires_grad_(True)
    mu = prox - math.log(weight)
    adv = torch.tensor([[advantage]], dtype=torch.float64)
    terms = decoupled_ppo_loss(logp, prox, mu, adv, torch.ones_like(adv), cfg=cfg)
    terms.loss.sum().backward()
    assert logp.grad is not None
    return terms, float(logp.grad)


@pytest.mark.parametrize(
    ("ratio", "advantage", "loss", "grad", "clipped", "dual"),
    [
        # loss = max(-A r, -A clip(r, 0.8, 1.2)), then min(., -3A) when A < 0; d/dlogp = -A r
        (1.0, 1.0, -1.0, -1.0, False, False),  # on the proximal policy: plain policy gradient
        (1.0, -1.0, 1.0, 1.0, False, False),
        (1.5, 1.0, -1.2, 0.0, True, False),  # max(-1.5, -1.2) = -1.2: clipped, no gradient
        (1.5, -1.0, 1.5, 1.5, False, False),  # max(1.5, 1.2) = 1.5 < 3: unclipped, grad r
        (4.0, -1.0, 3.0, 0.0, False, True),  # max(4, 1.2) = 4 > 3: dual clip, loss -cA = 3
        (0.5, 1.0, -0.5, -0.5, False, False),  # below the band with A > 0: NOT a clip
        (0.5, -1.0, 0.8, 0.0, True, False),  # max(0.5, 0.8) = 0.8: clipped
    ],
)
def test_ppo_clip_dual_clip_and_honest_clip_flags(
    ratio: float, advantage: float, loss: float, grad: float, *, clipped: bool, dual: bool
) -> None:
    terms, got_grad = _one(ratio, 1.0, advantage)
    assert float(terms.loss.detach()) == pytest.approx(loss)
    assert got_grad == pytest.approx(grad, abs=1e-12)
    assert bool(terms.clipped) is clipped and bool(terms.dual_clipped) is dual


def test_defect_c_a_tiny_behaviour_probability_no_longer_explodes() -> None:
    # mu = 0.01, pi = 0.5, A = -1. Old loss -min(rA, clip(r)A) with r = pi/mu = 50 gave
    # dLoss/dlogp = -A r = 50. Ratio to mu, as for a row with no separate proximal policy:
    # dual clip: loss = min(max(50, 1.2), 3) = 3 and no gradient.
    terms, grad = _one(50.0, 1.0, -1.0)
    assert float(terms.loss.detach()) == pytest.approx(3.0) and grad == 0.0
    # Decoupled: pi_prox = pi, so r = 1 and the correction w = pi_prox/mu = 50 is capped at
    # C = 2: loss = 2 * (-A * 1) = 2 and the gradient -A r w = 2, not 50.
    terms, grad = _one(1.0, 50.0, -1.0)
    assert float(terms.loss.detach()) == pytest.approx(2.0) and grad == pytest.approx(2.0)
    assert bool(terms.corrected) and float(terms.weight) == pytest.approx(2.0)
    assert float(terms.behaviour_ratio) == pytest.approx(50.0)  # reported before the cap


def test_behaviour_correction_multiplies_every_token() -> None:
    # w = 1.5 inside the cap: loss = w * (-A r) = -1.5 for r = 1, A = 1; gradient -A r w.
    terms, grad = _one(1.0, 1.5, 1.0)
    assert float(terms.loss.detach()) == pytest.approx(-1.5) and grad == pytest.approx(-1.5)
    assert not bool(terms.corrected)


def test_mis_masks_tokens_outside_the_band() -> None:
    mis = PolicyLossConfig(**{**CFG.__dict__, "correction": Correction.MIS})
    # C = 2: w must lie in [0.5, 2]
    for w, kept in [(50.0, False), (0.25, False), (1.5, True), (0.5, True), (2.0, True)]:
        terms, grad = _one(1.0, w, 1.0, mis)
        expected = -w if kept else 0.0  # loss = w * (-A r) with A = r = 1
        assert float(terms.loss.detach()) == pytest.approx(expected), w
        assert grad == pytest.approx(expected), w
        assert bool(terms.corrected) is not kept


def test_log_ratios_are_clamped_so_no_gap_is_infinite() -> None:
    # A gap of 100 nats (exp overflows float32 above 88) is clamped to 20.
    terms, grad = _one(1.0, 1.0, -1.0, log_gap=100.0)
    assert float(terms.ratio) == pytest.approx(math.exp(20.0))
    assert float(terms.loss.detach()) == pytest.approx(3.0) and grad == 0.0  # dual clip
    terms, grad = _one(1.0, 1.0, 1.0, log_gap=100.0)
    assert float(terms.loss.detach()) == pytest.approx(-1.2) and grad == 0.0
    # prox 100 nats above mu: w = exp(20) before the cap, 2 after, finite in float32
    prox = torch.zeros(1, 1)
    one = torch.ones(1, 1)
    out = decoupled_ppo_loss(prox.clone(), prox, prox - 100.0, one, one, cfg=CFG)
    assert torch.isfinite(out.loss).all() and float(out.weight) == 2.0


def test_kl_estimators_by_hand() -> None:
    # pi = 0.5, pi_ref = 0.25: log r = ln 2
    logp = torch.tensor([math.log(0.5)], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([math.log(0.25)], dtype=torch.float64)
    ln2 = math.log(2.0)
    assert float(kl_penalty(logp.detach(), ref, KLEstimator.K1)) == pytest.approx(ln2)
    assert float(kl_penalty(logp.detach(), ref, KLEstimator.K2)) == pytest.approx(0.5 * ln2**2)
    k3 = kl_penalty(logp, ref, KLEstimator.K3)  # exp(-ln 2) + ln 2 - 1 = 0.5 + ln 2 - 1
    assert float(k3.detach()) == pytest.approx(0.5 + ln2 - 1.0)
    k3.sum().backward()  # d/dlogp = 1 - exp(-log r) = 0.5
    assert float(logp.grad) == pytest.approx(0.5)  # type: ignore[arg-type]
    same = torch.tensor([-1.3])
    for estimator in KLEstimator:
        assert float(kl_penalty(same, same.clone(), estimator)) == 0.0


def test_clipped_value_loss_by_hand() -> None:
    # V = 1.0, V_old = 0.5, R = 2, clip 0.2: V_clip = 0.7; 0.5 max(1, 1.69) = 0.845, no gradient
    v = torch.tensor([1.0, 0.6], dtype=torch.float64, requires_grad=True)
    old = torch.tensor([0.5, 0.5], dtype=torch.float64)
    ret = torch.tensor([2.0, 2.0], dtype=torch.float64)
    loss = clipped_value_loss(v, old, ret, 0.2)
    # V = 0.6 inside the clip: 0.5 (0.6 - 2)^2 = 0.98, gradient V - R = -1.4
    assert loss.detach().tolist() == pytest.approx([0.845, 0.98])
    loss.sum().backward()
    assert v.grad.tolist() == pytest.approx([0.0, -1.4])  # type: ignore[union-attr]


def test_aggregation_modes() -> None:
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])

    def agg(mode: Aggregation, rows: slice = slice(None)) -> float:
        return float(aggregate(loss[rows], mask[rows], mode, total_tokens=4, total_sequences=2))

    assert agg(Aggregation.TOKEN_MEAN) == pytest.approx((1 + 2 + 3 + 4) / 4)
    assert agg(Aggregation.SEQ_MEAN) == pytest.approx((6 / 3 + 4 / 1) / 2)
    assert agg(Aggregation.SEQ_MEAN_TOKEN_SUM) == pytest.approx((6 + 4) / 2)
    for mode in Aggregation:  # shares of micro-batches add up to the whole batch's loss
        assert agg(mode, slice(0, 1)) + agg(mode, slice(1, 2)) == pytest.approx(agg(mode))


def test_dr_grpo_divides_by_a_constant_not_the_lengths() -> None:
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    got = aggregate(
        loss,
        mask,
        Aggregation.SEQ_MEAN_TOKEN_SUM_NORM,
        total_tokens=4,
        total_sequences=2,
        norm_tokens=8,
    )
    assert float(got) == pytest.approx((6 / 8 + 4 / 8) / 2)


def _rows(
    cfg: PolicyLossConfig,
    log_w: list[list[float]],
    mask: list[list[float]],
    log_r: list[list[float]] | None = None,
) -> tuple[PolicyTerms, torch.Tensor]:
    """Two-token rows with ``log pi_prox - log mu = log_w`` and A = 1; (terms, dloss/dlogp)."""
    prox = torch.full((len(log_w), 2), math.log(0.5), dtype=torch.float64)
    gap = torch.tensor(
        log_r if log_r is not None else [[0.0, 0.0]] * len(log_w), dtype=torch.float64
    )
    logp = (prox + gap).requires_grad_(True)
    mu = prox - torch.tensor(log_w, dtype=torch.float64)
    m = torch.tensor(mask, dtype=torch.float64)
    terms = decoupled_ppo_loss(logp, prox, mu, torch.ones_like(prox), m, cfg=cfg)
    (terms.loss * m).sum().backward()
    assert logp.grad is not None
    return terms, logp.grad


def test_sequence_correction_weights_the_whole_sequence_by_the_product() -> None:
    # verl's sequence TIS: w = prod of the sequence's token ratios = exp(0.3 + 0.2) (cap 2),
    # the same weight on both tokens; a masked-out token's ratio does not count.
    seq = PolicyLossConfig(**{**CFG.__dict__, "level": CorrectionLevel.SEQUENCE})
    terms, _ = _rows(seq, [[0.3, 0.2], [0.3, 5.0]], [[1, 1], [1, 0]])
    assert terms.weight[0].tolist() == pytest.approx([math.exp(0.5)] * 2)
    assert terms.weight[1].tolist() == pytest.approx([math.exp(0.3)] * 2)
    # the product can pass the cap where no token does: exp(0.4 + 0.4) > 2
    terms, _ = _rows(seq, [[0.4, 0.4]], [[1, 1]])
    assert terms.weight[0].tolist() == pytest.approx([2.0, 2.0]) and bool(terms.corrected.all())
    assert terms.behaviour_ratio[0].tolist() == pytest.approx([math.exp(0.4)] * 2)


def test_geometric_mask_rejects_the_whole_sequence() -> None:
    # prime-rl's sequence mask: the geometric mean exp((0.1 + 1.5) / 2) = exp(0.8) > C = 2
    # rejects both tokens, though the first alone would pass; the other row is kept whole.
    geo = PolicyLossConfig(
        **{**CFG.__dict__, "correction": Correction.MIS, "level": CorrectionLevel.GEOMETRIC}
    )
    terms, grad = _rows(geo, [[0.1, 1.5], [0.1, 0.5]], [[1, 1], [1, 1]])
    assert terms.rejected[0].tolist() == [True, True] and terms.rejected[1].tolist() == [False] * 2
    assert grad[0].tolist() == [0.0, 0.0]
    assert grad[1].tolist() == pytest.approx([-math.exp(0.3)] * 2)  # -A r w, w = exp(0.3)


def test_gspo_clips_the_sequence_ratio_and_keeps_each_tokens_gradient() -> None:
    # GSPO: s = exp(mean log r) = exp((0.1 + 0.3) / 2) = exp(0.2) > 1.2, A > 0: the whole
    # sequence is clipped and has no gradient. In a row with s = exp(0.05), inside the band,
    # each token's loss -A s carries its own gradient -A s (straight through).
    gspo = PolicyLossConfig(**{**CFG.__dict__, "ratio": PolicyRatio.SEQUENCE})
    terms, grad = _rows(
        gspo, [[0.0, 0.0], [0.0, 0.0]], [[1, 1], [1, 1]], log_r=[[0.1, 0.3], [0.0, 0.1]]
    )
    assert terms.ratio[0].tolist() == pytest.approx([math.exp(0.2)] * 2)
    assert terms.clipped[0].tolist() == [True, True] and grad[0].tolist() == [0.0, 0.0]
    assert terms.ratio[1].tolist() == pytest.approx([math.exp(0.05)] * 2)
    assert grad[1].tolist() == pytest.approx([-math.exp(0.05)] * 2)


def test_k1_and_k3_straight_through_carry_k2s_gradient() -> None:
    ln2 = math.log(2.0)
    ref = torch.tensor([math.log(0.25)], dtype=torch.float64)
    for estimator, value in [(KLEstimator.K1_ST, ln2), (KLEstimator.K3_ST, 0.5 + ln2 - 1.0)]:
        logp = torch.tensor([math.log(0.5)], dtype=torch.float64, requires_grad=True)
        out = kl_penalty(logp, ref, estimator)
        out.sum().backward()
        assert float(out.detach()) == pytest.approx(value), estimator
        assert float(logp.grad) == pytest.approx(ln2), estimator  # type: ignore[arg-type]


def test_gspo_defaults_no_dual_clip_and_seq_mean_token_mean() -> None:
    # A sequence with A < 0 and GSPO ratio s = 4.5: verl's GSPO has no dual clip, so each token
    # keeps the gradient -A s = 4.5. The token ratio's default dual clip (3) zeroed it.
    gspo = LossConfig(policy_ratio=PolicyRatio.SEQUENCE)
    cfg = PolicyLossConfig.of(OptimConfig(), gspo)
    assert cfg.dual_clip is None
    prox = torch.full((1, 2), math.log(0.1), dtype=torch.float64)
    logp = (prox + math.log(4.5)).requires_grad_(True)
    adv, mask = torch.full((1, 2), -1.0, dtype=torch.float64), torch.ones(1, 2)
    terms = decoupled_ppo_loss(logp, prox, prox, adv, mask, cfg=cfg)
    terms.loss.sum().backward()
    assert logp.grad is not None and logp.grad[0].tolist() == pytest.approx([4.5, 4.5])
    assert not terms.dual_clipped.any()
    # each default is overridable: an explicit c applies to GSPO too, 0 turns it off
    assert LossConfig(policy_ratio=PolicyRatio.SEQUENCE, dual_clip=3.0).dual_clip_c == 3.0
    assert PolicyLossConfig.of(OptimConfig(), LossConfig()).dual_clip == 3.0
    assert LossConfig(dual_clip=0.0).dual_clip_c is None
    with pytest.raises(ValueError, match="dual_clip"):
        LossConfig(dual_clip=0.5)
    # aggregation: seq-mean-token-mean for GSPO, token-mean otherwise, unless set
    assert loss_aggregation(OptimConfig(), gspo) is Aggregation.SEQ_MEAN
    assert loss_aggregation(OptimConfig(), LossConfig()) is Aggregation.TOKEN_MEAN
    chosen = OptimConfig(aggregation=Aggregation.TOKEN_MEAN)
    assert loss_aggregation(chosen, gspo) is Aggregation.TOKEN_MEAN


def test_gspo_defaults_reach_the_learner_from_its_flags() -> None:
    cfg = LearnerConfig.load({"model": "m", "policy_ratio": "sequence"}, environ={})
    assert cfg.loss.dual_clip_c is None
    assert loss_aggregation(cfg.optim, cfg.loss) is Aggregation.SEQ_MEAN
    cfg = LearnerConfig.load(
        {"model": "m", "policy_ratio": "sequence", "dual_clip": 2.5, "aggregation": "token-mean"},
        environ={},
    )
    assert cfg.loss.dual_clip_c == 2.5
    assert loss_aggregation(cfg.optim, cfg.loss) is Aggregation.TOKEN_MEAN
