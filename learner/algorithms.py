"""The learner's maths as pure functions: returns, advantages, the policy loss.

Nothing here touches Redis, files or a model; every function maps arrays to
arrays so that each one can be checked against hand-computed numbers.

Conventions (documented in docs/learner.md):

* Per-turn return ``G_t = r_t + gamma*G_{t+1}``; an episode's return is ``G_0``.
* ``grpo``: ``A_i = (R_i - mean_g R) / (std_g R + eps)`` with the population
  std of the group's episode returns; every turn of episode ``i`` gets ``A_i``.
* ``rloo``: ``A_i = R_i - mean_{j!=i} R_j`` (leave-one-out baseline).
* ``reinforce``: ``A_{i,t} = G_{i,t}``, no baseline.
* ``rebn`` (GEM's Return Batch Normalisation): ``A_{i,t} = (G_{i,t} - mean_B G) /
  (std_B G + eps)`` over every turn of every episode in the batch.
* A group whose episode returns are all equal carries no learning signal for
  the group-relative estimators; it is reported as zero-variance, whatever the
  algorithm, so the caller can count and (by default) skip it.
* Loss: token-level PPO-clip on ``r = exp(logpi_theta - logmu)`` against the behaviour
  logprobs mu recorded at rollout. Tokens of stale groups the config chose to
  correct use the truncated-importance-sampling policy gradient
  ``-min(r, rho_bar)*A*logpi_theta`` (``r`` detached, as in IMPALA/V-trace).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from learner.config import Aggregation, Algorithm

EPS = 1e-6


# rewards[group][episode][turn]
BatchRewards = Sequence[Sequence[Sequence[float]]]


@dataclass(frozen=True)
class Advantages:
    """Per-turn advantages, nested like the rewards, plus per-group zero-variance flags."""

    values: list[list[np.ndarray]]  # [group][episode] -> float64 array, one entry per turn
    zero_variance: list[bool]  # [group]: all episode returns equal


def discounted_returns(rewards: Sequence[float], gamma: float) -> np.ndarray:
    """Per-turn returns ``G_t = r_t + gamma G_{t+1}`` (float64, same length as ``rewards``)."""
    out = np.zeros(len(rewards), dtype=np.float64)
    running = 0.0
    for t in range(len(rewards) - 1, -1, -1):
        running = float(rewards[t]) + gamma * running
        out[t] = running
    return out


def episode_return(rewards: Sequence[float], gamma: float) -> float:
    """``G_0`` of an episode; 0 for an episode without turns."""
    returns = discounted_returns(rewards, gamma)
    return float(returns[0]) if len(returns) else 0.0


def _normalise(values: np.ndarray) -> np.ndarray:
    return (values - values.mean()) / (values.std() + EPS)


def _group_episode_advantages(algorithm: Algorithm, returns: np.ndarray) -> np.ndarray:
    """Episode-level advantage for each episode of one group."""
    n = len(returns)
    if algorithm is Algorithm.GRPO:
        return _normalise(returns)
    if algorithm is Algorithm.RLOO:
        if n < 2:
            return np.zeros(n)
        return returns - (returns.sum() - returns) / (n - 1)
    raise ValueError(f"{algorithm} is not an episode-level estimator")


def compute_advantages(rewards: BatchRewards, algorithm: Algorithm, gamma: float) -> Advantages:
    """Advantages for every turn of a batch of groups."""
    per_turn = [[discounted_returns(ep, gamma) for ep in group] for group in rewards]
    episode = [np.array([r[0] if len(r) else 0.0 for r in g], dtype=np.float64) for g in per_turn]
    zero_var = [bool(len(e) == 0 or np.all(e == e[0])) for e in episode]
    values: list[list[np.ndarray]] = []
    if algorithm in (Algorithm.GRPO, Algorithm.RLOO):
        for g_turns, g_ret in zip(per_turn, episode, strict=True):
            adv = _group_episode_advantages(algorithm, g_ret)
            values.append([np.full(len(t), a) for t, a in zip(g_turns, adv, strict=True)])
    elif algorithm is Algorithm.REINFORCE:
        values = [[t.copy() for t in g] for g in per_turn]
    else:  # REBN: normalise over the turns of the groups that will be trained
        kept = [t for g, z in zip(per_turn, zero_var, strict=True) if not z for t in g]
        flat = np.concatenate(kept) if kept else np.zeros(0)
        mean, std = (flat.mean(), flat.std()) if len(flat) else (0.0, 0.0)
        values = [[(t - mean) / (std + EPS) for t in g] for g in per_turn]
    return Advantages(values=values, zero_variance=zero_var)


def importance_ratio(logp: torch.Tensor, behaviour_logp: torch.Tensor) -> torch.Tensor:
    """``exp(logpi_theta - logmu)``, exactly 1 where the two agree."""
    return torch.exp(logp - behaviour_logp)


@dataclass(frozen=True)
class TokenLoss:
    """Per-token loss and the ratio it was computed from."""

    loss: torch.Tensor  # [B, T], differentiable
    ratio: torch.Tensor  # [B, T], detached
    clipped: torch.Tensor  # [B, T] bool, PPO clip active (|r - 1| > eps)


def policy_token_loss(
    logp: torch.Tensor,
    behaviour_logp: torch.Tensor,
    advantages: torch.Tensor,
    *,
    clip_low: float,
    clip_high: float,
    stale: torch.Tensor | None = None,
    tis_cap: float = 2.0,
) -> TokenLoss:
    """PPO-clip per token; rows flagged ``stale`` use truncated importance sampling.

    ``stale`` is a ``[B]`` bool tensor (``None``: nothing stale).
    """
    ratio = importance_ratio(logp, behaviour_logp)
    unclipped = ratio * advantages
    clipped_ratio = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    ppo = -torch.minimum(unclipped, clipped_ratio * advantages)
    loss = ppo
    if stale is not None and bool(stale.any()):
        weight = torch.clamp(ratio.detach(), max=tis_cap)
        tis = -weight * advantages * logp
        loss = torch.where(stale[:, None], tis, ppo)
    detached = ratio.detach()
    is_clipped = (detached < 1.0 - clip_low) | (detached > 1.0 + clip_high)
    return TokenLoss(loss=loss, ratio=detached, clipped=is_clipped)


def aggregate(
    token_loss: torch.Tensor,
    mask: torch.Tensor,
    mode: Aggregation,
    *,
    total_tokens: int,
    total_sequences: int,
) -> torch.Tensor:
    """This micro-batch's share of the batch loss.

    The denominators are those of the *whole* batch (all micro-batches, all
    ranks), so summing the shares, or their gradients, gives exactly the loss
    of the full batch: gradient accumulation and data parallelism change
    nothing but rounding.
    """
    masked = token_loss * mask
    if mode is Aggregation.TOKEN_MEAN:
        return masked.sum() / max(total_tokens, 1)
    per_seq = masked.sum(dim=1) / mask.sum(dim=1).clamp(min=1.0)
    return per_seq.sum() / max(total_sequences, 1)


def token_entropy(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of each position's next-token distribution (``[B, T]``)."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    return -(logprobs.exp() * logprobs).sum(dim=-1)
