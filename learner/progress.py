"""Is there anything left to learn? Batches that train nothing, and a solved task.

A group whose samples all score the same gives GRPO-style estimators no signal, and a
batch of only such groups is skipped (not a step). Once a toy is solved, or when the
tasks are too hard, that is nearly every batch: the workers keep generating while the
learner stands still. This module makes both cases loud, on every batch, trained or not:

- `IdleWatch` logs a WARNING once `idle_warn_batches` batches in a row trained nothing,
  naming the cause (zero-variance groups and their common reward: all 1.0 is solved,
  all 0.0 too hard; infrastructure failures; stale groups) and the remedies. It warns
  again at twice, four times, ... that many (a solved run would otherwise log a warning
  every second), and logs one INFO when a batch trains again.
- `SolvedWatch` ends the run (``--stop-when-solved``) once the mean reward of the last
  `solved_mean_batches` (10) batches has stayed at or above `solved_reward` (0.95) for
  `solved_window` (20) batches in a row. It counts batches, not steps: once solved, steps are rare (most
  batches are skipped), and waiting for ten of them is the waste it exists to end.

deploy/prometheus's `FarmNothingToTrain` watches the same zero-variance share from the
learner's counters.
"""

from __future__ import annotations

import json
import logging
from collections import deque
from dataclasses import dataclass, field
from typing import Protocol

from pydantic import ConfigDict, Field
from pydantic.dataclasses import dataclass as config_dataclass

log = logging.getLogger("learner")


@config_dataclass(frozen=True, config=ConfigDict(extra="forbid"))
class ProgressRules:
    """When a run that trains nothing is reported, and when a solved run stops."""

    idle_warn_batches: int = Field(
        20,
        ge=0,
        le=1_000_000,
        description="WARNING after this many batches in a row train "
        "nothing, again at 2x, 4x, ... (0: never)",
    )
    stop_when_solved: bool = Field(
        False, description="stop once the mean reward of the last batches stays >= solved_reward"
    )
    solved_reward: float = Field(
        0.95, description="the mean reward that counts as solved (--stop-when-solved)"
    )
    solved_mean_batches: int = Field(
        10, ge=1, le=100_000, description="batches (trained or skipped) that mean is taken over"
    )
    solved_window: int = Field(
        20, ge=1, le=1_000_000, description="batches in a row the mean must hold to stop"
    )


class Batch(Protocol):
    """What the watches read of a batch: `learner.record`'s StepRecord or SkipRecord (named
    by shape: learner.config holds ProgressRules, and the records' modules import it)."""

    step: int
    groups: int
    reward_mean: float
    zero_variance: int
    zero_variance_reward: float | None
    infra_failed: int
    no_action_timeouts: int
    stale_dropped: int


@dataclass
class IdleWatch:
    """The current streak of batches that trained nothing, and what their groups were."""

    limit: int  # batches in a row before the first WARNING (0: never)
    streak: int = 0
    groups: int = 0
    zero_variance: int = 0
    zero_variance_reward: float = 0.0  # sum of the zero-variance groups' common returns
    infra_failed: int = 0
    stale_dropped: int = 0
    warned_at: int = 0  # streak length of the last WARNING

    def observe(self, record: Batch, trained: bool) -> None:
        """Count one batch (`trained`: it was a step); log when the streak of untrained ones
        reaches the limit (and doubles), or ends."""
        if trained:
            if self.warned_at:
                log.info(
                    "training again at step %d after %d idle batches", record.step, self.streak
                )
            self.streak = self.groups = self.zero_variance = self.infra_failed = 0
            self.stale_dropped = self.warned_at = 0
            self.zero_variance_reward = 0.0
            return
        self.streak += 1
        self.groups += record.groups
        self.zero_variance += record.zero_variance
        self.zero_variance_reward += (record.zero_variance_reward or 0.0) * record.zero_variance
        self.infra_failed += record.infra_failed + record.no_action_timeouts
        self.stale_dropped += record.stale_dropped
        if self.limit and self.streak >= max(self.limit, 2 * self.warned_at):
            self.warned_at = self.streak
            log.warning("%s", self.message(record.step))

    def message(self, step: int) -> str:
        """The WARNING: what the streak's groups were, and what to do about them."""
        head = f"{self.streak} batches in a row trained nothing (still at step {step}): "
        parts = [f"{self.zero_variance} of {self.groups} groups had zero variance"]
        if self.zero_variance:
            parts[0] += f" ({common_reward_text(self.zero_variance_reward / self.zero_variance)})"
        if self.infra_failed:
            parts.append(f"{self.infra_failed} failed in the infrastructure")
        if self.stale_dropped:
            parts.append(f"{self.stale_dropped} were dropped as stale")
        remedy = (
            " Every sample of a zero-variance group scored the same, so it has no advantage to "
            "learn from. Remedies: --dynamic-sampling (fill batches with groups that vary), "
            "--difficulty-filter N (defer tasks that are always solved or always failed), "
            "harder tasks when they are all solved, easier ones when none is, or "
            "--stop-when-solved to end a solved run."
        )
        return head + ", ".join(parts) + "." + (remedy if self.zero_variance else "")


def common_reward_text(mean: float) -> str:
    """What zero-variance groups' mean common reward says: "all 1.0: solved", ..."""
    if mean >= 1.0 - 1e-6:
        return f"all {mean:.1f}: solved"
    if abs(mean) <= 1e-6:
        return "all 0.0: too hard"
    return f"mean reward {mean:.2f}"


@dataclass
class SolvedWatch:
    """The last batches' rewards and how long their mean has held `rules.solved_reward`."""

    rules: ProgressRules
    rewards: deque[float] = field(default_factory=deque)
    held: int = 0  # batches in a row with the mean at or above the target

    def observe(self, record: Batch) -> str | None:
        """Count one batch; once solved (and asked to stop), the reason to stop, else None."""
        if not self.rules.stop_when_solved:
            return None
        if record.groups <= record.infra_failed + record.no_action_timeouts:
            return None  # nothing was scored: says nothing about the reward
        window = self.rules.solved_mean_batches
        self.rewards.append(record.reward_mean)
        if len(self.rewards) > window:
            self.rewards.popleft()
        mean = sum(self.rewards) / len(self.rewards)
        full = len(self.rewards) == window
        self.held = self.held + 1 if full and mean >= self.rules.solved_reward else 0
        if self.held < self.rules.solved_window:
            return None
        return (
            f"solved: the {window}-batch mean reward {mean:.3f} stayed >= "
            f"{self.rules.solved_reward:g} for {self.held} batches (step {record.step})"
        )


@dataclass
class Progress:
    """Both watches, fed every batch by the learner loop (live and replay)."""

    idle: IdleWatch
    solved: SolvedWatch

    @classmethod
    def of(cls, rules: ProgressRules) -> Progress:
        return cls(IdleWatch(rules.idle_warn_batches), SolvedWatch(rules))

    def observe(self, record: Batch, trained: bool) -> bool:
        """Count one batch (`trained`: it was a step); True once the run is solved and should
        stop (logged as an ``{"event": "solved"}`` line, `farm`'s stop reason then)."""
        self.idle.observe(record, trained)
        reason = self.solved.observe(record)
        if reason is None:
            return False
        log.info("%s", json.dumps({"event": "solved", "step": record.step, "reason": reason}))
        return True
