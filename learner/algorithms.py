"""The learner's maths as pure functions: returns, advantages, GAE, reward shaping.

Nothing here touches Redis, files or a model; every function maps arrays to
arrays so that each one can be checked against hand-computed numbers. The loss
terms (decoupled PPO, KL, value loss, aggregation) are in `learner.losses`.

Conventions (documented in docs/learner.md, with the peers that use each):

* Per-turn return ``G_t = r_t + gamma*G_{t+1}``; an episode's return is ``G_0``.
* ``grpo``: ``A_i = (R_i - mean_g R) / (std_g R + eps)``; the std is the
  population one by default (``GroupStd``), and dividing by it can be switched
  off (Dr. GRPO). Every turn of episode ``i`` gets ``A_i``.
* ``rloo``: ``A_i = R_i - mean_{j!=i} R_j`` (leave-one-out baseline).
* ``reinforce``: ``A_{i,t} = G_{i,t}``, no baseline.
* ``rebn`` (GEM's Return Batch Normalisation): ``A_{i,t} = (G_{i,t} - mean_B G) /
  (std_B G + eps)`` over every turn of every episode in the batch.
* ``reinforce++`` (REINFORCE++, verl's ``reinforce_plus_plus``): the same whitening, but
  over the batch's completion *tokens*' returns (each turn's return weighs by its token
  count; with a per-token reward, token j's return counts only the reward from j on);
  ``reinforce++-baseline`` subtracts the group's mean episode return first.
* ``ppo``: per-token GAE from a critic (`gae`), computed by `learner.critic`.
* Only the group-relative estimators (grpo, rloo) flag a group whose episode
  returns are all equal as zero-variance: their advantages there are all 0.
  The other estimators keep the signal of such a group."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from learner.config import Algorithm, GroupStd

EPS = 1e-6


# rewards[group][episode][turn] (and completion tokens per turn, nested the same way)
BatchRewards = Sequence[Sequence[Sequence[float]]]
# per-token return offsets, one array per turn nested like the rewards: entry j is the
# penalty on the turn's tokens before token j (a per-token KL reward), so token j's return is
# the turn's return plus it (the return from token j on counts only what comes from j on)
TokenOffsets = Sequence[Sequence[Sequence[np.ndarray]]]


@dataclass(frozen=True)
class Advantages:
    """Per-turn advantages, nested like the rewards, plus per-group zero-variance flags.

    ``values[g][e][k]`` is the advantage of turn k's first completion token; token j of the
    turn has ``values[g][e][k] + token_scale * offsets[g][e][k][j]`` (without offsets, every
    token of a turn shares its value). Every estimator is affine in the returns, and
    ``token_scale`` is its slope: 0 for the episode-level ones (grpo, rloo), whose tokens all
    carry their episode's advantage, as verl sums a token-level reward into the score.
    """

    values: list[list[np.ndarray]]  # [group][episode] -> float64 array, one entry per turn
    zero_variance: list[bool]  # [group]: all episode returns equal
    token_scale: float = 0.0  # d advantage / d return of the token-level estimators


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


def _normalise(values: np.ndarray, scale: bool = True, ddof: int = 0) -> np.ndarray:
    centred = values - values.mean()
    if not scale:
        return centred
    if len(values) <= ddof:  # one sample: no spread to divide by, and no signal
        return np.zeros_like(values)
    return centred / (values.std(ddof=ddof) + EPS)


@dataclass(frozen=True)
class AdvantageRules:
    """How returns become advantages."""

    algorithm: Algorithm
    gamma: float
    scale_by_std: bool = True  # grpo: divide by the group std
    std: GroupStd = GroupStd.POPULATION  # grpo: which std


def _group_episode_advantages(rules: AdvantageRules, returns: np.ndarray) -> np.ndarray:
    """Episode-level advantage for each episode of one group."""
    n = len(returns)
    if rules.algorithm is Algorithm.GRPO:
        ddof = 1 if rules.std is GroupStd.UNBIASED else 0
        return _normalise(returns, rules.scale_by_std, ddof)
    if rules.algorithm is Algorithm.RLOO:
        if n < 2:
            return np.zeros(n)
        return returns - (returns.sum() - returns) / (n - 1)
    raise ValueError(f"{rules.algorithm} is not an episode-level estimator")


def _token_whitened(
    returns: list[list[np.ndarray]], offsets: list[list[list[np.ndarray]]]
) -> tuple[list[list[np.ndarray]], float]:
    """``(G - mean) / (std + eps)`` over every completion token's return (turn k's token j:
    ``G_k + offsets[k][j]``), as per-turn values and the slope ``1 / (std + eps)``."""
    flat = [
        g + o
        for gr, go in zip(returns, offsets, strict=True)
        for r, os in zip(gr, go, strict=True)
        for g, o in zip(r, os, strict=True)
    ]
    tokens = np.concatenate(flat or [np.zeros(0)])
    if not len(tokens):
        return [[np.zeros_like(t) for t in g] for g in returns], 0.0
    mean, scale = tokens.mean(), 1.0 / (float(tokens.std()) + EPS)
    return [[(t - mean) * scale for t in g] for g in returns], scale


def _offsets_or_flat(
    returns: list[list[np.ndarray]], tokens: BatchRewards | None, offsets: TokenOffsets | None
) -> list[list[list[np.ndarray]]]:
    """Per-turn token offsets: the given ones, else zeros, one per completion token (one per
    turn without token counts)."""
    if offsets is not None:
        return [[[np.asarray(o, np.float64) for o in ep] for ep in g] for g in offsets]
    counts = tokens if tokens is not None else [[[1] * len(t) for t in g] for g in returns]
    return [[[np.zeros(int(n)) for n in ep] for ep in g] for g in counts]


def compute_advantages(
    rewards: BatchRewards,
    rules: AdvantageRules,
    tokens: BatchRewards | None = None,
    offsets: TokenOffsets | None = None,
) -> Advantages:
    """Advantages for every turn of a batch of groups (``ppo``: zeros, the critic fills them).

    `tokens` (completion tokens per turn, nested like `rewards`) weighs the turns for
    ``reinforce++``; without it every turn weighs one. `offsets` (per-token return offsets of
    a per-token reward) make the token-level estimators' advantages differ within a turn.
    """
    per_turn = [[discounted_returns(ep, rules.gamma) for ep in group] for group in rewards]
    episode = [np.array([r[0] if len(r) else 0.0 for r in g], dtype=np.float64) for g in per_turn]
    zero_var = [
        rules.algorithm.group_relative and bool(len(e) == 0 or np.all(e == e[0])) for e in episode
    ]
    values: list[list[np.ndarray]] = []
    scale = 0.0
    if rules.algorithm in (Algorithm.REINFORCE_PP, Algorithm.REINFORCE_PP_BASELINE):
        if rules.algorithm is Algorithm.REINFORCE_PP_BASELINE:
            per_turn = [[t - e.mean() for t in g] for g, e in zip(per_turn, episode, strict=True)]
        values, scale = _token_whitened(per_turn, _offsets_or_flat(per_turn, tokens, offsets))
    elif rules.algorithm.group_relative:
        for g_turns, g_ret in zip(per_turn, episode, strict=True):
            adv = _group_episode_advantages(rules, g_ret)
            values.append([np.full(len(t), a) for t, a in zip(g_turns, adv, strict=True)])
    elif rules.algorithm is Algorithm.REINFORCE:
        values, scale = [[t.copy() for t in g] for g in per_turn], 1.0
    elif rules.algorithm is Algorithm.PPO:
        values = [[np.zeros_like(t) for t in g] for g in per_turn]
    else:  # REBN: normalise over every turn of the batch
        flat = np.concatenate([t for g in per_turn for t in g] or [np.zeros(0)])
        mean, std = (flat.mean(), flat.std()) if len(flat) else (0.0, 0.0)
        scale = 1.0 / (std + EPS)
        values = [[(t - mean) * scale for t in g] for g in per_turn]
    return Advantages(values=values, zero_variance=zero_var, token_scale=scale)


def overlong_penalty(length: int, max_tokens: int, buffer: int, penalty: float) -> float:
    """DAPO's soft overlong punishment of an episode of ``length`` completion tokens.

    0 up to ``max_tokens - buffer``, then falling linearly to ``-penalty`` at
    ``max_tokens``, and ``-penalty`` beyond.
    """
    start = max_tokens - buffer
    if length <= start:
        return 0.0
    return -penalty * min((length - start) / buffer, 1.0)


def gae(
    rewards: np.ndarray,
    values: np.ndarray,
    mask: np.ndarray,
    gamma: float,
    lam: float,
    *,
    bootstrap: float = 0.0,
) -> tuple[np.ndarray, np.ndarray]:
    """Per-token GAE over the tokens where ``mask`` is 1; (advantages, returns).

    ``delta_t = r_t + gamma V_next - V_t`` and ``A_t = delta_t + gamma lam A_next``,
    where "next" is the next *masked-in* token: prompt-side tokens of later turns
    (mask 0) are skipped, so the recursion runs across turns as if they were not
    there, and a reward on such a token is never read (the caller puts each turn's
    reward on a completion token). After the last token ``A_next = 0`` and ``V_next`` is
    `bootstrap`: 0 when the episode terminated, the value of the state after its last
    token when a limit truncated it (the episode would have gone on). Returns ``A + V``;
    both outputs are 0 where the mask is 0.
    """
    adv = np.zeros(len(rewards), dtype=np.float64)
    next_value, next_adv = float(bootstrap), 0.0
    for t in range(len(rewards) - 1, -1, -1):
        if mask[t] <= 0:
            continue
        delta = float(rewards[t]) + gamma * next_value - float(values[t])
        next_adv = delta + gamma * lam * next_adv
        next_value = float(values[t])
        adv[t] = next_adv
    returns = np.where(np.asarray(mask) > 0, adv + np.asarray(values, dtype=np.float64), 0.0)
    return adv, returns
