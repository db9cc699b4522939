"""Is the run making progress? Spoiled batches and dead-lettered tasks, watched.

Two ways a run can train nothing forever while looking busy, each stopped here
with a `RunFailedError` that names the dominant error and an example:

- `FailureWatch`: `limit` batches in a row with no trainable sample because every
  group carries an infrastructure error (env, sandbox, inference: typically every
  episode failing the same way). A batch that trained something, or whose groups
  simply scored the same (the model got 0 everywhere: that is learning, not failure),
  ends the streak.
- `DeadLetterWatch`: tasks the workers dead-letter (a spec only a worker can reject,
  an undecodable task, too many deliveries) never come back as groups. It reads the
  dead-letter stream from where the learner started, gives each such task's admission
  slot back, and fails the run once `limit` of them arrive with no group in between.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

import redis.asyncio as aioredis

from broker.codec import decode
from broker.connection import as_str, redis_errors
from broker.errors import DecodeError
from broker.keys import RunKeys
from broker.messages import DeadLetter, TrajectoryGroup
from learner.batch import no_action_timeout
from learner.errors import RunFailedError


def spoiled(groups: Sequence[TrajectoryGroup], trained_samples: int) -> bool:
    """Whether a batch trained nothing only because the infrastructure failed it."""
    return bool(groups) and trained_samples == 0 and all(_infra(g) for g in groups)


def _infra(group: TrajectoryGroup) -> bool:
    # a timeout before the first action is the infrastructure's failure too (issue 15, B)
    return group.infra_failed or any(no_action_timeout(t) for t in group.trajectories)


@dataclass
class FailureWatch:
    """Consecutive spoiled batches, with the error categories seen in them."""

    limit: int  # spoiled batches in a row that stop the run (0: never)
    streak: int = 0
    categories: Counter[str] = field(default_factory=Counter)
    examples: dict[str, str] = field(default_factory=dict)  # category -> one error detail

    def observe(self, groups: Sequence[TrajectoryGroup], trained_samples: int) -> None:
        """Count one batch; raise RunFailedError once `limit` in a row were spoiled."""
        if not spoiled(groups, trained_samples):
            self.streak = 0
            self.categories.clear()
            self.examples.clear()
            return
        self.streak += 1
        for trajectory in (t for g in groups for t in g.trajectories):
            if trajectory.error.is_infrastructure or no_action_timeout(trajectory):
                category = trajectory.error.value
                self.categories[category] += 1
                self.examples.setdefault(category, trajectory.error_detail or "(no detail)")
        if self.limit and self.streak >= self.limit:
            raise RunFailedError(self.summary())

    def summary(self) -> str:
        category, count = self.categories.most_common(1)[0]
        total = sum(self.categories.values())
        return (
            f"{self.streak} batches in a row had no trainable sample: every group failed with an "
            f"infrastructure error, mostly '{category}' ({count} of {total} failed episodes); "
            f"example: {self.examples[category]}"
        )


class DeadLetterWatch:
    """Reads the run's dead letters as they come (every partition's dead-letter stream,
    one XREAD each: they sit in different cluster slots); frees and counts those of tasks."""

    def __init__(self, redis: aioredis.Redis, keys: RunKeys, limit: int) -> None:
        self.redis = redis
        self.keys = keys
        self.limit = limit  # task dead letters in a row, no group between, that fail the run
        self.streak = 0
        self.latest = ""  # reason of the latest task dead letter
        self._last_ids = {stream: "0-0" for stream in keys.all_deadletters}
        self._owed = 0  # task dead letters read but not yet returned by poll()

    async def start(self) -> None:
        """Skip what is already there: those tasks are not in the recount of slots in flight."""
        for stream in self._last_ids:
            with redis_errors("reading the dead letters"):
                last = await self.redis.xrevrange(stream, count=1)
            if last:
                raw = last[0][0]
                self._last_ids[stream] = as_str(raw)

    async def poll(self) -> int:
        """Task dead letters since the last poll (their slots are the caller's to release)."""
        for stream, last_id in self._last_ids.items():
            with redis_errors("reading the dead letters"):
                reply = await self.redis.xread({stream: last_id}, count=1000)
            # Counted as soon as the cursor moves: an outage at the next stream keeps them.
            self._owed += self._count_tasks(stream, [e for _, got in reply or [] for e in got])
        tasks, self._owed = self._owed, 0
        self.streak += tasks
        return tasks

    def _count_tasks(self, stream: str, entries: list[tuple[bytes, dict[bytes, bytes]]]) -> int:
        tasks = 0
        for raw_id, fields in entries:
            self._last_ids[stream] = as_str(raw_id)
            try:
                letter = decode(fields, expect=DeadLetter)
            except DecodeError:
                continue
            assert isinstance(letter, DeadLetter)
            if letter.source_stream in self.keys.all_tasks:
                tasks += 1
                self.latest = letter.reason
        return tasks

    def groups_arrived(self) -> None:
        self.streak = 0

    def check(self) -> None:
        if self.limit and self.streak >= self.limit:
            raise RunFailedError(
                f"{self.streak} tasks in a row were dead-lettered by the workers and no group "
                f"came back; latest reason: {self.latest}"
            )
