"""The learner's loss terms as pure functions of per-token tensors.

Every function maps ``[B, T]`` tensors to ``[B, T]`` tensors (or one number for
`aggregate`), so each can be checked against hand-computed values. Three
policies meet in the decoupled PPO loss (AReaL, verl's rollout correction):

* mu, the behaviour policy: logprobs recorded by inference at rollout;
* pi_prox, the proximal policy: logprobs the learner recomputes with the
  weights it holds before the batch's first update (with one epoch and one
  mini-batch they equal pi_theta's, detached, and cost no extra forward);
* pi_theta, the policy being trained.

``loss = w * ppo(pi_theta / pi_prox, A)``, where ``ppo`` is PPO-clip with the
dual clip for A < 0 and ``w = pi_prox / mu`` is the behaviour correction on
every token, truncated (TIS) or masked outside ``[1/C, C]`` (MIS), never
differentiated. ``w`` is the token's own ratio, or one weight for the whole
sequence: the product of its tokens' ratios (verl's sequence TIS) or their
geometric mean (prime-rl's sequence mask). The clipped ratio is the token's, or
GSPO's sequence ratio (the geometric mean of the sequence's ``pi_theta/pi_prox``,
carrying each token's own gradient). Every log-ratio is clamped before ``exp`` so
that no gap between policies gives an infinite loss or gradient.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from learner.config import (
    Aggregation,
    Correction,
    CorrectionLevel,
    KLEstimator,
    LossConfig,
    OptimConfig,
    PolicyRatio,
)


@dataclass(frozen=True)
class PolicyLossConfig:
    """The knobs of the decoupled PPO loss."""

    clip_low: float  # ratio floor 1 - clip_low
    clip_high: float  # ratio ceiling 1 + clip_high
    dual_clip: float | None  # c > 1: for A < 0 the loss never exceeds -c*A; None: off
    correction: Correction  # tis | mis
    cap: float  # C of TIS/MIS
    log_ratio_clamp: float  # |log ratio| bound before exp
    level: CorrectionLevel = CorrectionLevel.TOKEN  # what one behaviour weight covers
    ratio: PolicyRatio = PolicyRatio.TOKEN  # the clipped ratio: per token, or GSPO's

    @classmethod
    def of(cls, optim: OptimConfig, loss: LossConfig) -> PolicyLossConfig:
        """The loss knobs, from the two config sections that hold them."""
        return cls(
            clip_low=optim.clip_low,
            clip_high=optim.clip_high,
            dual_clip=loss.dual_clip_c,
            correction=loss.correction,
            cap=optim.tis_cap,
            log_ratio_clamp=loss.log_ratio_clamp,
            level=loss.correction_level,
            ratio=loss.policy_ratio,
        )


@dataclass(frozen=True)
class PolicyTerms:
    """Per-token loss and what it was made of (all but ``loss`` detached)."""

    loss: torch.Tensor  # [B, T], differentiable
    ratio: torch.Tensor  # pi_theta / pi_prox
    weight: torch.Tensor  # behaviour correction after the cap or mask
    clipped: torch.Tensor  # bool: PPO clip active, the token has no gradient
    dual_clipped: torch.Tensor  # bool: dual clip active, the token has no gradient
    corrected: torch.Tensor  # bool: pi_prox/mu was capped (TIS) or masked (MIS)
    behaviour_ratio: torch.Tensor  # the token's own pi_prox/mu (inference mismatch)
    rejected: torch.Tensor  # bool: masked by MIS, out of the loss and its denominator


def clamped_ratio(logp: torch.Tensor, other: torch.Tensor, limit: float) -> torch.Tensor:
    """``exp(clamp(logp - other, -limit, limit))``: exactly 1 where the two agree."""
    return torch.exp(torch.clamp(logp - other, -limit, limit))


def sequence_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``[B, 1]``: the mean of each row's masked-in values (0 for a row with none)."""
    return (values * mask).sum(dim=-1, keepdim=True) / mask.sum(dim=-1, keepdim=True).clamp(min=1)


def behaviour_weight(
    log_w: torch.Tensor, mask: torch.Tensor, cfg: PolicyLossConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight, corrected) from each token's ``log w = log pi_prox - log mu`` (clamped).

    The weight is per token, or per sequence (the product or the geometric mean of its
    tokens' w, broadcast to its tokens); TIS caps it at C, MIS zeroes it outside [1/C, C].
    """
    if cfg.level is CorrectionLevel.TOKEN:
        level = log_w
    elif cfg.level is CorrectionLevel.SEQUENCE:
        level = (log_w * mask).sum(dim=-1, keepdim=True).expand_as(log_w)
    else:
        level = sequence_mean(log_w, mask).expand_as(log_w)
    w = torch.exp(torch.clamp(level, -cfg.log_ratio_clamp, cfg.log_ratio_clamp))
    if cfg.correction is Correction.TIS:
        return torch.clamp(w, max=cfg.cap), w > cfg.cap
    keep = (w >= 1.0 / cfg.cap) & (w <= cfg.cap)
    return torch.where(keep, w, torch.zeros_like(w)), ~keep


def _policy_ratio(
    logp: torch.Tensor, prox_logp: torch.Tensor, mask: torch.Tensor, cfg: PolicyLossConfig
) -> torch.Tensor:
    """pi_theta/pi_prox per token, or GSPO's: ``exp(sg[mean_seq log r] + log pi - sg[log pi])``."""
    log_r = logp - prox_logp.detach()
    if cfg.ratio is PolicyRatio.SEQUENCE:
        log_r = logp - logp.detach() + sequence_mean(log_r.detach(), mask)
    return torch.exp(torch.clamp(log_r, -cfg.log_ratio_clamp, cfg.log_ratio_clamp))


def decoupled_ppo_loss(
    logp: torch.Tensor,
    prox_logp: torch.Tensor,
    behaviour_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    cfg: PolicyLossConfig,
) -> PolicyTerms:
    """``w * max(-A r, -A clip(r))`` with ``r = pi_theta/pi_prox``, capped at ``-c A`` for A < 0
    (the dual clip, unless it is off)."""
    ratio = _policy_ratio(logp, prox_logp, mask, cfg)
    low, high = 1.0 - cfg.clip_low, 1.0 + cfg.clip_high
    clip_loss = torch.maximum(-advantages * ratio, -advantages * torch.clamp(ratio, low, high))
    negative = advantages < 0
    ppo, dual_clipped = clip_loss, torch.zeros_like(negative)
    if cfg.dual_clip is not None:
        ppo = torch.where(negative, torch.minimum(clip_loss, -advantages * cfg.dual_clip), ppo)
        dual_clipped = negative & (ratio.detach() > cfg.dual_clip)
    log_w = torch.clamp(
        prox_logp.detach() - behaviour_logp, -cfg.log_ratio_clamp, cfg.log_ratio_clamp
    )
    weight, corrected = behaviour_weight(log_w, mask, cfg)
    r = ratio.detach()
    positive = advantages > 0
    clipped = (positive & (r > high)) | (negative & (r < low))
    return PolicyTerms(
        loss=ppo * weight,
        ratio=r,
        weight=weight,
        clipped=clipped,
        dual_clipped=dual_clipped,
        corrected=corrected,
        behaviour_ratio=torch.exp(log_w),
        rejected=corrected if cfg.correction is Correction.MIS else torch.zeros_like(corrected),
    )


def kl_penalty(
    logp: torch.Tensor, ref_logp: torch.Tensor, estimator: KLEstimator, limit: float = 20.0
) -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from ``log r = logp - ref_logp`` (clamped).

    k1 ``log r``; k2 ``(log r)^2 / 2``; k3 ``exp(-log r) + log r - 1``. The expected
    gradients of k1 and k3 are not the gradient of the KL, k2's is: ``k1+``/``k3+`` give
    k1's or k3's value with k2's gradient (straight through, as verl's ``k3+``).
    """
    log_r = torch.clamp(logp - ref_logp, -limit, limit)
    k2 = 0.5 * log_r.square()
    if estimator is KLEstimator.K2:
        return k2
    value = (
        log_r
        if estimator in (KLEstimator.K1, KLEstimator.K1_ST)
        else torch.exp(-log_r) + log_r - 1.0
    )
    if estimator in (KLEstimator.K1_ST, KLEstimator.K3_ST):
        return k2 - k2.detach() + value.detach()
    return value


def clipped_value_loss(
    values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, clip: float
) -> torch.Tensor:
    """``0.5 max((V - R)^2, (V_old + clip(V - V_old, -e, e) - R)^2)`` per token (PPO2, verl)."""
    clipped = old_values + torch.clamp(values - old_values, -clip, clip)
    return 0.5 * torch.maximum((values - returns).square(), (clipped - returns).square())


def aggregate(
    token_loss: torch.Tensor,
    mask: torch.Tensor,
    mode: Aggregation,
    *,
    total_tokens: int,
    total_sequences: int,
    norm_tokens: int | None = None,
) -> torch.Tensor:
    """This micro-batch's share of the (mini-)batch loss.

    The denominators are those of the *whole* (mini-)batch (all micro-batches,
    all ranks), so summing the shares, or their gradients, gives exactly the
    loss of the full batch: gradient accumulation and data parallelism change
    nothing but rounding. ``seq-mean-token-sum`` sums each sequence's token losses
    and averages the sequences, so no length normalisation biases it;
    ``seq-mean-token-sum-norm`` (Dr. GRPO) divides those sums by a constant
    ``norm_tokens`` as well, so the loss scale does not move with the batch's lengths.
    """
    masked = token_loss * mask
    if mode is Aggregation.TOKEN_MEAN:
        return masked.sum() / max(total_tokens, 1)
    per_seq = masked.sum(dim=1)
    if mode is Aggregation.SEQ_MEAN:
        per_seq = per_seq / mask.sum(dim=1).clamp(min=1.0)
    elif mode is Aggregation.SEQ_MEAN_TOKEN_SUM_NORM:
        per_seq = per_seq / float(norm_tokens or 1)
    return per_seq.sum() / max(total_sequences, 1)
