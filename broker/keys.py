"""Every Redis key and stream name the farm uses, in one place, and their slot layout.

Each key carries a Redis Cluster hash tag, the part in braces, which picks its slot.
Trajectory partition ``p`` owns the tag ``{run}`` for ``p == 0`` and ``{run:p}``
otherwise (``:`` is not allowed in a run name, so tags never collide across runs).
Under a partition's tag live every key its atomic commit touches: its tasks stream,
its trajectories stream, its dead-letter stream and the consumer groups' seen sets.
So the worker's publish + XACK + mark-seen script and the learner's ack stay within
one slot, while the partitions of one run spread over several slots (and nodes).
Partition 0 keeps the names a single-partition run always had.

Run-wide keys (admission budget, policy, stats) live under ``{run}``: the admission
budget is one hash touched only by single-key scripts, so it binds the whole run.
No other module spells a key name as a string literal.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_RUN_CHARS = r"[A-Za-z0-9_.-]{1,64}"  # no ":" and no braces: tags never collide across runs
RUN_NAME_PATTERN = f"^{_RUN_CHARS}$"  # what every role's `run` setting must match
MAX_PARTITIONS = 256  # trajectory/task partitions of one run: 1..MAX_PARTITIONS
_RUN_NAME = re.compile(RUN_NAME_PATTERN)
_TAG = re.compile(r"^\{(" + _RUN_CHARS + r")(?::(\d+))?\}")

# Consumer-group names. Workers share one group on the tasks streams; the
# learner owns one group on each trajectories partition. Each evaluator (the learner's
# evaluation, a `learner evaluate`) reads the eval streams through a group of its own.
WORKERS_GROUP = "workers"
LEARNER_GROUP = "learner"
# A following archiver's position on its stream (`broker.archive`): a group with nothing
# pending whose last delivery is the last entry a segment holds, so trimming waits for it.
ARCHIVER_GROUP = "archiver"
EVAL_GROUP_PREFIX = "eval-"


def hash_tag(key: str) -> str:
    """The hash tag that picks `key`'s cluster slot (the whole key if it has none)."""
    start = key.find("{")
    end = key.find("}", start + 1)
    return key[start + 1 : end] if start >= 0 and end > start + 1 else key


@dataclass(frozen=True)
class RunKeys:
    """Names of all keys belonging to one run."""

    run: str
    partitions: int = 1

    def __post_init__(self) -> None:
        if not _RUN_NAME.match(self.run):
            raise ValueError(f"run name must match {_RUN_NAME.pattern!r}, got {self.run!r}")
        if not 1 <= self.partitions <= MAX_PARTITIONS:
            raise ValueError(f"partitions must be in 1..{MAX_PARTITIONS}, got {self.partitions}")

    @property
    def prefix(self) -> str:
        """The run-wide hash tag, which is also partition 0's."""
        return "{" + self.run + "}"

    def _tag(self, partition: int) -> str:
        if not 0 <= partition < self.partitions:
            raise ValueError(f"partition {partition} out of range 0..{self.partitions - 1}")
        return self.prefix if partition == 0 else "{" + f"{self.run}:{partition}" + "}"

    def partition_of(self, key: str) -> int:
        """The partition whose hash tag `key` carries (0 for run-wide keys)."""
        match = _TAG.match(key)
        if match is None or match.group(1) != self.run:
            raise ValueError(f"{key!r} is not a key of run {self.run!r}")
        partition = int(match.group(2) or 0)
        self._tag(partition)  # range check
        return partition

    def task_stream(self, partition: int = 0) -> str:
        """The tasks stream of one partition; partition 0's is `tasks`."""
        return f"{self._tag(partition)}:tasks"

    @property
    def tasks(self) -> str:
        return self.task_stream(0)

    @property
    def all_tasks(self) -> tuple[str, ...]:
        return tuple(self.task_stream(p) for p in range(self.partitions))

    def trajectories(self, partition: int = 0) -> str:
        """The trajectories stream of one partition."""
        return f"{self._tag(partition)}:trajectories"

    @property
    def all_trajectories(self) -> tuple[str, ...]:
        return tuple(self.trajectories(p) for p in range(self.partitions))

    def evals(self, partition: int = 0) -> str:
        """The eval-results stream of one partition: groups of eval tasks (`Task.eval`), which
        never enter a trajectories stream, so no learner can train them."""
        return f"{self._tag(partition)}:evals"

    @property
    def all_evals(self) -> tuple[str, ...]:
        return tuple(self.evals(p) for p in range(self.partitions))

    def deadletter_of(self, partition: int = 0) -> str:
        """The dead-letter stream for entries of one partition's streams."""
        return f"{self._tag(partition)}:deadletter"

    @property
    def deadletter(self) -> str:
        return self.deadletter_of(0)

    @property
    def all_deadletters(self) -> tuple[str, ...]:
        return tuple(self.deadletter_of(p) for p in range(self.partitions))

    @property
    def policy_version(self) -> str:
        """Hash holding the latest published PolicyVersion body."""
        return f"{self.prefix}:policy"

    @property
    def last_eval(self) -> str:
        """String holding the newest evaluation's summary (`broker.status.publish_eval`)."""
        return f"{self.prefix}:eval:last"

    @property
    def policy_events(self) -> str:
        """Stream of every PolicyVersion published, for replay and audit."""
        return f"{self.prefix}:policy:events"

    @property
    def admission(self) -> str:
        """Hash holding the staleness/admission budget (limit, in_flight)."""
        return f"{self.prefix}:admission"

    def seen(self, group: str, partition: int = 0) -> str:
        """Sorted set of message ids a consumer group has committed in one partition (dedup)."""
        return f"{self._tag(partition)}:seen:{group}"

    @property
    def stats(self) -> str:
        """Hash of farm-level counters that `farm status` shows."""
        return f"{self.prefix}:stats"

    @property
    def streams(self) -> tuple[str, ...]:
        return (
            *self.all_tasks,
            *self.all_trajectories,
            *self.all_evals,
            *self.all_deadletters,
            self.policy_events,
        )
