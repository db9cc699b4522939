"""Every Redis key and stream name the farm uses, in one place.

All keys of one run share the hash tag ``{run}`` so that a run lives on one
Redis Cluster slot and multi-key scripts (admission, commit pipelines) work
there. No other module spells a key name as a string literal.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_RUN_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")

# Consumer-group names. Workers share one group on the tasks stream; the
# learner owns one group on each trajectories partition.
WORKERS_GROUP = "workers"
LEARNER_GROUP = "learner"


@dataclass(frozen=True)
class RunKeys:
    """Names of all keys belonging to one run."""

    run: str
    partitions: int = 1

    def __post_init__(self) -> None:
        if not _RUN_NAME.match(self.run):
            raise ValueError(f"run name must match {_RUN_NAME.pattern!r}, got {self.run!r}")
        if not 1 <= self.partitions <= 256:
            raise ValueError(f"partitions must be in 1..256, got {self.partitions}")

    @property
    def prefix(self) -> str:
        return "{" + self.run + "}"

    @property
    def tasks(self) -> str:
        return f"{self.prefix}:tasks"

    def trajectories(self, partition: int = 0) -> str:
        """The trajectories stream; partition 0 keeps the unsuffixed name."""
        if not 0 <= partition < self.partitions:
            raise ValueError(f"partition {partition} out of range 0..{self.partitions - 1}")
        base = f"{self.prefix}:trajectories"
        return base if partition == 0 else f"{base}:{partition}"

    @property
    def all_trajectories(self) -> tuple[str, ...]:
        return tuple(self.trajectories(p) for p in range(self.partitions))

    @property
    def deadletter(self) -> str:
        return f"{self.prefix}:deadletter"

    @property
    def policy_version(self) -> str:
        """Hash holding the latest published PolicyVersion body."""
        return f"{self.prefix}:policy"

    @property
    def policy_events(self) -> str:
        """Stream of every PolicyVersion published, for replay and audit."""
        return f"{self.prefix}:policy:events"

    @property
    def admission(self) -> str:
        """Hash holding the staleness/admission budget (limit, in_flight)."""
        return f"{self.prefix}:admission"

    def seen(self, group: str) -> str:
        """Set of message ids a consumer group has already committed (dedup)."""
        return f"{self.prefix}:seen:{group}"

    @property
    def stats(self) -> str:
        """Hash of farm-level counters that `farm status` shows."""
        return f"{self.prefix}:stats"

    @property
    def streams(self) -> tuple[str, ...]:
        return (self.tasks, *self.all_trajectories, self.deadletter, self.policy_events)
