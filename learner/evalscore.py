"""Scoring an evaluation: pure functions from eval groups to mean@k, pass@k and mixes.

An eval task runs `k` samples of one row of an eval set. A sample succeeds when its episode
return reaches the success threshold. Per set and per environment: mean@k (the mean episode
return over every scored sample), pass@1 and pass@k with the unbiased estimator of Chen et
al. (2021), 1 - C(n-c, k) / C(n, k) averaged over rows, the finish-reason and error-category
mix, mean tokens and turns per episode, and the share of episodes that went past their first
turn (``multi_turn``: in a tool environment whose turn without a call ends the episode, such
as ``calc``, the share of episodes that called a tool). A row with an episode spoiled by the
infrastructure (`ErrorCategory.is_infrastructure`) is left out of the score and counted in
``infra_failed_rows``: the model is never scored on the farm's failures.
"""

from __future__ import annotations

import collections
from collections.abc import Iterable, Sequence

from broker.messages import FinishReason, TrajectoryGroup


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from `n` samples of which `c` passed: 1 - C(n-c, k) / C(n, k)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n} c={c} k={k}")
    if n - c < k:
        return 1.0
    miss = 1.0  # C(n-c, k) / C(n, k) as a product, exact enough and never overflowing
    for i in range(n - c + 1, n + 1):
        miss *= 1.0 - k / i
    return 1.0 - miss


def _episode_return(group: TrajectoryGroup, index: int) -> float:
    return float(sum(t.reward for t in group.trajectories[index].turns))


def score(groups: Sequence[TrajectoryGroup], k: int, threshold: float) -> dict[str, float]:
    """The figures of a set of eval groups (each one row, `k` samples or more)."""
    finish: collections.Counter[str] = collections.Counter()
    errors: collections.Counter[str] = collections.Counter()
    returns: list[float] = []
    pass1: list[float] = []
    passk: list[float] = []
    tokens = turns = episodes = infra = multi = 0
    for group in groups:
        for t in group.trajectories:
            episodes += 1
            finish[t.finish_reason.value] += 1
            if t.finish_reason is FinishReason.ERROR:
                errors[t.error.value] += 1
            turns += len(t.turns)
            multi += len(t.turns) > 1
            tokens += sum(len(turn.completion_ids) for turn in t.turns)
        if group.infra_failed:
            infra += 1
            continue
        rs = [_episode_return(group, i) for i in range(len(group.trajectories))]
        n, c = len(rs), sum(r >= threshold for r in rs)
        returns += rs
        pass1.append(pass_at_k(n, c, 1))
        passk.append(pass_at_k(n, c, min(k, n)))
    out = {
        "rows": float(len(groups)),
        "scored_rows": float(len(pass1)),
        "infra_failed_rows": float(infra),
        "mean_at_k": _mean(returns),
        "pass_at_1": _mean(pass1),
        f"pass_at_{k}": _mean(passk),
        "tokens_mean": tokens / episodes if episodes else 0.0,
        "turns_mean": turns / episodes if episodes else 0.0,
        "multi_turn": multi / episodes if episodes else 0.0,
    }
    for name, count in finish.items():
        out[f"finish/{name}"] = count / episodes
    for name, count in errors.items():
        out[f"error/{name}"] = count / episodes
    return out


def _mean(values: Iterable[float]) -> float:
    values = list(values)
    return float(sum(values) / len(values)) if values else 0.0


def env_name(group: TrajectoryGroup) -> str:
    return group.task.env_spec.split("@", 1)[0]


def score_sets(
    groups: Sequence[TrajectoryGroup], k: int, threshold: float
) -> dict[str, dict[str, float]]:
    """Figures per eval set (key ``SET``) and per set and environment (``SET/ENV``)."""
    by_key: dict[str, list[TrajectoryGroup]] = collections.defaultdict(list)
    for group in groups:
        assert group.task.eval is not None
        name = group.task.eval.set_name
        by_key[name].append(group)
        by_key[f"{name}/{env_name(group)}"].append(group)
    return {key: score(rows, k, threshold) for key, rows in sorted(by_key.items())}
