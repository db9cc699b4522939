"""Is the policy collapsing? Deterministic prompts, the rollout entropy, and a falling reward.

A policy that answers every prompt with probability ~1 cannot learn any more from GRPO-style
estimators: each prompt's group is all right or all wrong, its returns have no variance,
and no gradient reaches it. That is fine while the answers are right (a solved task), and a
silent dead end once they drift wrong. This module measures it on every batch, trained or
skipped:

- a **deterministic** group is one whose samples are all the same token for token (every
  turn's completion; at least two samples, infrastructure failures left out): the prompt
  was answered the same way every time, which zero variance alone does not say (different
  answers may score the same);
- the **rollout entropy** is the mean of -log μ over every sampled completion token of the
  batch (μ: the behaviour logprob, under the distribution the token was drawn from): an
  estimate of the sampling policy's per-token entropy in nats. Unlike the trainer's
  entropy it covers the groups that were not trained (zero variance), which is where a
  collapsed policy's prompts go.

`CollapseWatch` logs one WARNING when, over the last `window` batches, the rollout entropy
stays under `entropy` while the mean reward has fallen `reward_drop` or more below the best
`window`-batch mean the run has had, and one INFO once it has recovered: the entropy back
to twice `entropy`, or the reward back within half of `reward_drop` (hysteresis: a policy
hovering at either threshold would otherwise warn every few batches, as the first one-hour
soak showed). deploy/prometheus's
`FarmPolicyCollapsed` watches the same two figures from their gauges.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
from pydantic import ConfigDict, Field
from pydantic.dataclasses import dataclass as config_dataclass

from broker.messages import TrajectoryGroup

log = logging.getLogger("learner")


@config_dataclass(frozen=True, config=ConfigDict(extra="forbid"))
class CollapseRules:
    """When a near-deterministic policy with a falling reward is reported as collapsed."""

    entropy: float = Field(
        0.05, ge=0.0, description="rollout entropy (nats/token) under which the policy is collapsed"
    )
    reward_drop: float = Field(
        0.1, gt=0.0, description="fall of the mean reward below its best window that counts"
    )
    window: int = Field(20, ge=1, le=100_000, description="batches each mean is taken over")


@dataclass(frozen=True)
class BatchShape:
    """What a batch says about how deterministic the policy is."""

    deterministic: int  # groups whose samples were all identical
    rollout_entropy: float | None  # mean -log μ over sampled tokens; None: no token sampled


NO_SHAPE = BatchShape(0, None)  # a record measured without its groups


def identical(group: TrajectoryGroup) -> bool:
    """Every sample of `group` the same token for token (two samples at least)."""
    runs = group.trajectories
    if len(runs) < 2:
        return False
    first = runs[0].turns
    for other in runs[1:]:
        if len(other.turns) != len(first):
            return False
        for a, b in zip(first, other.turns, strict=True):
            if not np.array_equal(a.completion_ids, b.completion_ids):
                return False
    return True


def batch_shape(groups: Sequence[TrajectoryGroup]) -> BatchShape:
    """The deterministic groups and the rollout entropy of a batch (infra failures left out)."""
    kept = [g for g in groups if not g.infra_failed]
    total, tokens = 0.0, 0
    for group in kept:
        for trajectory in group.trajectories:
            for turn in trajectory.turns:
                total -= float(np.sum(turn.logprobs, dtype=np.float64))
                tokens += len(turn.logprobs)
    entropy = round(total / tokens, 6) if tokens else None
    return BatchShape(sum(identical(g) for g in kept), entropy)


@dataclass
class CollapseWatch:
    """The last `window` batches' reward and rollout entropy, and the best reward window."""

    rules: CollapseRules
    rewards: deque[float] = field(default_factory=deque)
    entropies: deque[float] = field(default_factory=deque)
    best: float = float("-inf")  # best `window`-batch mean reward so far
    collapsed: bool = False

    def observe(self, reward_mean: float, rollout_entropy: float | None, step: int) -> bool:
        """Count one batch; log on entering or leaving collapse; return whether collapsed."""
        if rollout_entropy is None:  # nothing sampled (every group failed): says nothing
            return self.collapsed
        window = self.rules.window
        for values, value in ((self.rewards, reward_mean), (self.entropies, rollout_entropy)):
            values.append(value)
            if len(values) > window:
                values.popleft()
        if len(self.rewards) < window:
            return self.collapsed
        reward, entropy = float(np.mean(self.rewards)), float(np.mean(self.entropies))
        self.best = max(self.best, reward)
        drop, rules = self.best - reward, self.rules
        if self.collapsed:
            now = entropy < 2 * rules.entropy and drop >= rules.reward_drop / 2
        else:
            now = entropy < rules.entropy and drop >= rules.reward_drop
        if now and not self.collapsed:
            log.warning(
                "policy collapse at step %d: rollout entropy %.4f nats/token (under %g) over "
                "the last %d batches while the mean reward fell from %.3f to %.3f. A "
                "deterministic policy's groups have no variance, so nothing can correct it: "
                "resume from an earlier checkpoint, add --entropy-coef or a KL term "
                "(--kl-coef), or sample at a higher temperature",
                step,
                entropy,
                self.rules.entropy,
                window,
                self.best,
                reward,
            )
        elif self.collapsed and not now:
            log.info(
                "policy collapse over at step %d: rollout entropy %.4f, mean reward %.3f",
                step,
                entropy,
                reward,
            )
        self.collapsed = now
        return now
