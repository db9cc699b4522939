"""The learner's per-step record: one typed structure, logged as one JSON line and exported.

`StepRecord.measure` builds it from what a step produced (the prepared batch, the
trainer's statistics, timings); `emit` writes it as ``{"event": "step", ...}`` and
updates the Prometheus metrics from its typed fields. The loss statistics are None
on a step that trained nothing (every group filtered out) and are then left out of
the log line, as before.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from dataclasses import dataclass

import numpy as np

from learner import metrics as m
from learner.batch import PreparedBatch
from learner.collapse import NO_SHAPE, BatchShape
from learner.trainer import StepStats

log = logging.getLogger("learner")

LOSS_FIELDS = (
    "loss",
    "clip_fraction",
    "entropy",
    "ratio_mean",
    "ratio_max",
    "grad_norm",
    "dual_clip_fraction",
    "correction_fraction",
    "kl",
    "behaviour_ratio_mean",
    "behaviour_ratio_max",
    "behaviour_ratio_min",
    "behaviour_log_ratio_std",
    "outside_mass",
    "rejected_fraction",
    "optimizer_steps",
    "zero_gradient_steps",
    "value_loss",
    "learning_rate",
    "kl_coef",
)


@dataclass(frozen=True)
class StepRecord:
    """What one learner step did and measured."""

    step: int  # steps done, this one included
    version: int  # policy version the servers hold after this step
    groups: int  # groups in the batch
    trained_groups: int  # groups whose samples were trained
    samples: int  # sequences trained
    tokens: int  # tokens of those sequences
    reward_mean: float  # mean episode return over the batch's non-failed groups
    adv_mean: float  # mean turn advantage trained
    adv_std: float
    staleness_max: int  # largest policy lag among the batch's groups
    zero_variance: int  # groups whose returns were all equal
    deterministic: int  # groups whose samples were all identical (learner.collapse)
    infra_failed: int  # groups failed by the infrastructure (not trained)
    no_action_timeouts: int  # groups with an episode that timed out before acting (not trained)
    overlong: int  # trajectories cut by the context limit
    stale_dropped: int
    stale_corrected: int
    wait_s: float  # waiting for the batch
    compute_s: float  # forward, backward and optimizer
    push_s: float  # weight push and verification (0 when not pushed)
    samples_per_s: float
    rollout_entropy: float | None = None  # mean -log μ of every sampled token (learner.collapse)
    zero_variance_reward: float | None = None  # mean common return of those groups (None: none)
    loss: float | None = None  # the statistics below: None when nothing was trained
    clip_fraction: float | None = None
    entropy: float | None = None  # of the sampled distribution (allowed set, truncation)
    ratio_mean: float | None = None
    ratio_max: float | None = None
    grad_norm: float | None = None
    dual_clip_fraction: float | None = None  # tokens whose dual clip was active
    correction_fraction: float | None = None  # tokens whose pi_prox/mu was capped or masked
    kl: float | None = None  # mean per-token KL estimate to the reference
    behaviour_ratio_mean: float | None = None  # pi_prox/mu before the cap
    behaviour_ratio_max: float | None = None
    behaviour_ratio_min: float | None = None
    behaviour_log_ratio_std: float | None = None  # spread of log(pi_prox/mu) over the tokens
    outside_mass: float | None = None  # policy mass outside the tokens' sampled support
    rejected_fraction: float | None = None  # tokens MIS left out of the loss
    learning_rate: float | None = None  # of this step's updates (--lr-schedule)
    kl_coef: float | None = None  # of this step (moved by --kl-target)
    optimizer_steps: int | None = None  # taken: ppo_epochs x mini_batches, less the below
    zero_gradient_steps: int | None = None  # not taken: the gradient was exactly zero
    value_loss: float | None = None  # the critic's clipped value loss (ppo)
    filter_rate: float | None = None  # dynamic sampling's measured filter rate

    @classmethod
    def measure(
        cls,
        step: int,
        version: int,
        groups: int,
        prepared: PreparedBatch,
        stats: StepStats | None,
        *,
        wait_s: float,
        push_s: float,
        shape: BatchShape = NO_SHAPE,
    ) -> StepRecord:
        """The record of a step from its batch, its statistics and its timings."""
        returns = np.asarray(prepared.episode_returns or [0.0])
        adv = np.asarray(prepared.advantages or [0.0])
        compute_s = stats.compute_s if stats else 0.0
        losses = {name: getattr(stats, name) for name in LOSS_FIELDS} if stats else {}
        return cls(
            step=step,
            version=version,
            groups=groups,
            trained_groups=len(prepared.trained_groups),
            samples=len(prepared.samples),
            tokens=prepared.num_tokens,
            reward_mean=float(returns.mean()),
            adv_mean=float(adv.mean()),
            adv_std=float(adv.std()),
            staleness_max=max(prepared.staleness, default=0),
            zero_variance=len(prepared.zero_variance),
            deterministic=shape.deterministic,
            infra_failed=len(prepared.infra_failed),
            no_action_timeouts=len(prepared.no_action_timeouts),
            overlong=prepared.overlong,
            stale_dropped=len(prepared.dropped_stale),
            stale_corrected=len(prepared.corrected_stale),
            wait_s=round(wait_s, 4),
            compute_s=round(compute_s, 4),
            push_s=round(push_s, 4),
            samples_per_s=round(len(prepared.samples) / max(wait_s + compute_s, 1e-9), 2),
            rollout_entropy=shape.rollout_entropy,
            zero_variance_reward=_common_return(prepared),
            **losses,
        )

    def as_json(self) -> dict[str, object]:
        """The log line's object: the event name first, absent statistics left out."""
        fields = dataclasses.asdict(self)
        return {"event": "step", **{k: v for k, v in fields.items() if v is not None}}


def emit(record: StepRecord, prepared: PreparedBatch) -> None:
    """Log the step and update the metrics."""
    log.info("%s", json.dumps(record.as_json()))
    m.STEPS.inc()
    m.STEP_SECONDS.observe(record.wait_s + record.compute_s)
    m.WAIT_SECONDS.observe(record.wait_s)
    m.SAMPLES.inc(record.samples)
    m.REWARD_MEAN.set(record.reward_mean)
    m.ADVANTAGE_MEAN.set(record.adv_mean)
    m.ADVANTAGE_STD.set(record.adv_std)
    m.POLICY_VERSION.set(record.version)
    m.LAST_STEP.set(time.time())
    for s in prepared.staleness:
        m.STALENESS.observe(s)
    m.STALE_GROUPS.labels(action="dropped").inc(record.stale_dropped)
    m.STALE_GROUPS.labels(action="corrected").inc(record.stale_corrected)
    _count_groups(record.groups, prepared)
    _shape_gauges(record.groups, record.deterministic, record.rollout_entropy)
    m.INFRA_FAILED.inc(record.infra_failed)
    m.NO_ACTION_TIMEOUTS.inc(record.no_action_timeouts)
    m.OVERLONG.inc(record.overlong)
    gauges = {
        "loss": m.LOSS,
        "clip_fraction": m.CLIP_FRACTION,
        "entropy": m.ENTROPY,
        "ratio_mean": m.RATIO_MEAN,
        "ratio_max": m.RATIO_MAX,
        "grad_norm": m.GRAD_NORM,
        "dual_clip_fraction": m.DUAL_CLIP_FRACTION,
        "correction_fraction": m.CORRECTION_FRACTION,
        "kl": m.KL,
        "behaviour_ratio_max": m.BEHAVIOUR_RATIO_MAX,
        "behaviour_ratio_min": m.BEHAVIOUR_RATIO_MIN,
        "behaviour_log_ratio_std": m.BEHAVIOUR_LOG_RATIO_STD,
        "outside_mass": m.OUTSIDE_MASS,
        "value_loss": m.VALUE_LOSS,
    }
    for name, gauge in gauges.items():
        value = getattr(record, name)
        if value is not None:
            gauge.set(value)


@dataclass(frozen=True)
class SkipRecord:
    """A batch that trained nothing: not a step (no version, push or --max-steps)."""

    reason: str  # "no_samples": nothing trainable; "zero_gradient": no optimizer step moved
    step: int  # steps done so far (unchanged by this batch)
    version: int  # policy version the servers hold
    groups: int  # groups in the batch
    reward_mean: float  # mean episode return over the batch's non-failed groups
    zero_variance: int
    zero_variance_reward: float | None  # mean common return of those groups (None: none)
    deterministic: int  # groups whose samples were all identical
    rollout_entropy: float | None  # mean -log μ of every sampled token
    infra_failed: int
    no_action_timeouts: int
    stale_dropped: int
    wait_s: float

    @classmethod
    def measure(
        cls,
        step: int,
        version: int,
        groups: int,
        prepared: PreparedBatch,
        *,
        wait_s: float,
        shape: BatchShape = NO_SHAPE,
    ) -> SkipRecord:
        """The record of a skipped batch."""
        returns = np.asarray(prepared.episode_returns or [0.0])
        return cls(
            reason="zero_gradient" if prepared.samples else "no_samples",
            step=step,
            version=version,
            groups=groups,
            reward_mean=float(returns.mean()),
            zero_variance=len(prepared.zero_variance),
            zero_variance_reward=_common_return(prepared),
            deterministic=shape.deterministic,
            rollout_entropy=shape.rollout_entropy,
            infra_failed=len(prepared.infra_failed),
            no_action_timeouts=len(prepared.no_action_timeouts),
            stale_dropped=len(prepared.dropped_stale),
            wait_s=round(wait_s, 4),
        )

    def as_json(self) -> dict[str, object]:
        return {"event": "skipped", **dataclasses.asdict(self)}


def emit_skip(record: SkipRecord, prepared: PreparedBatch) -> None:
    """Log a skipped batch and count its groups."""
    log.info("%s", json.dumps(record.as_json()))
    m.SKIPPED_BATCHES.inc()
    if record.reason == "zero_gradient":
        m.ZERO_GRADIENT_BATCHES.inc()
    if prepared.episode_returns:
        m.REWARD_MEAN.set(record.reward_mean)
    m.STALE_GROUPS.labels(action="dropped").inc(record.stale_dropped)
    _count_groups(record.groups, prepared)
    _shape_gauges(record.groups, record.deterministic, record.rollout_entropy)
    m.INFRA_FAILED.inc(record.infra_failed)
    m.NO_ACTION_TIMEOUTS.inc(record.no_action_timeouts)


def _common_return(prepared: PreparedBatch) -> float | None:
    """The mean of the zero-variance groups' common returns (all 1.0: solved; 0.0: too hard)."""
    values = prepared.zero_variance_returns
    return round(float(np.mean(values)), 6) if values else None


def _count_groups(groups: int, prepared: PreparedBatch) -> None:
    """The batch's groups, its zero-variance ones and their returns' sum (their mean: the
    ratio of the two counters; `farm.view` shows it per status period)."""
    m.GROUPS.inc(groups)
    m.ZERO_VARIANCE.inc(len(prepared.zero_variance))
    m.ZERO_VARIANCE_REWARD.inc(sum(prepared.zero_variance_returns))


def _shape_gauges(groups: int, deterministic: int, rollout_entropy: float | None) -> None:
    """The collapse figures of the last batch, step or skipped (`FarmPolicyCollapsed`)."""
    if rollout_entropy is not None:
        m.ROLLOUT_ENTROPY.set(rollout_entropy)
    if groups:
        m.DETERMINISTIC_FRACTION.set(deterministic / groups)
