"""Dynamic sampling (DAPO): groups that train nothing never shrink a batch.

`DynamicSampling` tells the live source which groups count toward
``groups_per_batch`` (`learner.batch.filter_reason`: zero-variance groups of a
group-relative estimator, infrastructure failures, timeouts before the first
action) and measures the fraction filtered over a window of recent groups.
Filtered groups still travel with the batch, so they are counted, exported as
``farm_learner_filtered_groups_total{reason}`` and acked with the step's
checkpoint like any other. A batch stops growing at ``max_factor x
groups_per_batch`` groups however few of them count.

Admission over-issues in proportion to the measured rate: a step consumes about
``groups_per_batch / (1 - rate)`` groups, so `admission_limit` is that times the
steps the staleness budget allows. Staleness is counted in steps, so the bound
still holds: every admitted task is trained within ``max_staleness`` versions.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable

from broker.messages import TrajectoryGroup
from learner.metrics import FILTER_RATE, FILTERED_GROUPS


class DynamicSampling:
    """Which groups count toward a batch, and how many are filtered."""

    def __init__(
        self,
        reason: Callable[[TrajectoryGroup], str | None],
        groups_per_batch: int,
        max_factor: float,
        steps: int,
        window: int | None = None,
    ) -> None:
        self.reason = reason
        self.groups_per_batch = groups_per_batch
        self.steps = steps  # steps of groups the staleness budget admits (admission_steps)
        self.max_groups = max(groups_per_batch, int(max_factor * groups_per_batch))
        self.recent: deque[bool] = deque(maxlen=window or 4 * self.max_groups)

    def counts(self, group: TrajectoryGroup) -> bool:
        return self.reason(group) is None

    def observe(self, groups: list[TrajectoryGroup]) -> int:
        """Record a finished batch's groups; return how many were filtered."""
        filtered = 0
        for group in groups:
            reason = self.reason(group)
            self.recent.append(reason is not None)
            if reason is not None:
                filtered += 1
                FILTERED_GROUPS.labels(reason=reason).inc()
        FILTER_RATE.set(self.rate)
        return filtered

    @property
    def rate(self) -> float:
        return sum(self.recent) / len(self.recent) if self.recent else 0.0

    def groups_per_step(self) -> int:
        """Groups a step is expected to consume: ``ceil(gpb / (1 - rate))``, capped."""
        keep = max(1.0 - self.rate, self.groups_per_batch / self.max_groups)
        return min(self.max_groups, math.ceil(self.groups_per_batch / keep - 1e-9))

    def admission_limit(self) -> int:
        return self.steps * self.groups_per_step()

    def batch_length(self, groups: list[TrajectoryGroup], size: int) -> int | None:
        """Groups to take from the head of `groups` for a batch, or None to keep reading."""
        counted = 0
        for i, group in enumerate(groups[: self.max_groups]):
            counted += self.counts(group)
            if counted == size:
                return i + 1
        return self.max_groups if len(groups) >= self.max_groups else None
