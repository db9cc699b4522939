"""From trajectory groups to training sequences: filtering, advantages, assembly.

`prepare_batch` decides which groups of a batch are trained: groups whose
infrastructure failed are not (counted), groups older than `max_staleness` are
trained with truncated importance sampling or dropped (counted either way), and
zero-variance groups are skipped by default (counted). It then turns each kept
trajectory into one sequence: for every turn, ``prompt_ids`` (loss mask 0)
followed by ``completion_ids`` (loss mask 1, with the behaviour logprobs and the
turn's advantage), as broker/messages.py documents. No torch here: sequences
are numpy arrays, collated into tensors by the trainer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from broker.messages import Trajectory, TrajectoryGroup
from learner.algorithms import compute_advantages, episode_return
from learner.config import BatchRules


@dataclass(frozen=True)
class Sample:
    """One trajectory as a training sequence; all arrays have the sequence's length."""

    input_ids: np.ndarray  # int64 tokens
    loss_mask: np.ndarray  # float32, 1 on completion tokens
    behaviour_logp: np.ndarray  # float32, rollout logprob on completion tokens, 0 elsewhere
    advantages: np.ndarray  # float32, the token's turn advantage on completion tokens
    stale: bool  # train with truncated importance sampling
    group_id: str


@dataclass
class PreparedBatch:
    """Sequences to train plus what happened to every group of the batch."""

    samples: list[Sample] = field(default_factory=list)
    trained_groups: list[str] = field(default_factory=list)  # ids whose samples are in `samples`
    infra_failed: list[str] = field(default_factory=list)
    zero_variance: list[str] = field(default_factory=list)
    dropped_stale: list[str] = field(default_factory=list)
    corrected_stale: list[str] = field(default_factory=list)
    staleness: list[int] = field(default_factory=list)  # one per group that was not infra-failed
    episode_returns: list[float] = field(default_factory=list)  # every episode of those groups
    advantages: list[float] = field(default_factory=list)  # one per trained turn

    @property
    def num_tokens(self) -> int:
        return int(sum(s.loss_mask.sum() for s in self.samples))


def assemble(trajectory: Trajectory, turn_advantages: Sequence[float]) -> tuple[np.ndarray, ...]:
    """(input_ids, loss_mask, behaviour_logp, advantages) of one trajectory."""
    ids: list[np.ndarray] = []
    mask: list[np.ndarray] = []
    logp: list[np.ndarray] = []
    adv: list[np.ndarray] = []
    for turn, a in zip(trajectory.turns, turn_advantages, strict=True):
        n_p, n_c = len(turn.prompt_ids), len(turn.completion_ids)
        ids += [turn.prompt_ids, turn.completion_ids]
        mask += [np.zeros(n_p, np.float32), np.ones(n_c, np.float32)]
        logp += [np.zeros(n_p, np.float32), turn.logprobs.astype(np.float32)]
        adv += [np.zeros(n_p, np.float32), np.full(n_c, a, np.float32)]
    out = (
        np.concatenate(ids).astype(np.int64),
        np.concatenate(mask),
        np.concatenate(logp),
        np.concatenate(adv),
    )
    # Position 0 has no preceding token to predict it from, so it can never carry loss.
    out[1][:1] = 0.0
    return out


def _stale_action(staleness: int, rules: BatchRules) -> str:
    if staleness <= rules.max_staleness:
        return "fresh"
    return "drop" if rules.drop_stale else "correct"


def prepare_batch(
    groups: Sequence[TrajectoryGroup], rules: BatchRules, version: int, judge_staleness: bool = True
) -> PreparedBatch:
    """Filter the groups of one batch and assemble the sequences to train.

    `judge_staleness=False` trains every group as fresh (a replay: its versions are not
    this run's); staleness is still measured.
    """
    out = PreparedBatch()
    candidates: list[tuple[TrajectoryGroup, bool]] = []
    for group in groups:
        if group.infra_failed:
            out.infra_failed.append(group.group_id)
            continue
        staleness = max(0, version - group.min_weight_version)
        out.staleness.append(staleness)
        out.episode_returns += [
            episode_return([t.reward for t in tr.turns], rules.gamma) for tr in group.trajectories
        ]
        action = _stale_action(staleness, rules) if judge_staleness else "fresh"
        if action == "drop":
            out.dropped_stale.append(group.group_id)
            continue
        if action == "correct":
            out.corrected_stale.append(group.group_id)
        candidates.append((group, action == "correct"))
    rewards = [[[t.reward for t in tr.turns] for tr in g.trajectories] for g, _ in candidates]
    advs = compute_advantages(rewards, rules.algorithm, rules.gamma)
    for (group, stale), group_adv, zero_var in zip(
        candidates, advs.values, advs.zero_variance, strict=True
    ):
        if zero_var:
            out.zero_variance.append(group.group_id)
            if rules.skip_zero_variance:
                continue
        out.trained_groups.append(group.group_id)
        for trajectory, turn_adv in zip(group.trajectories, group_adv, strict=True):
            if not trajectory.turns:
                continue
            ids, mask, logp, adv = assemble(trajectory, turn_adv)
            if mask.sum() == 0:
                continue
            out.advantages += [float(a) for a in turn_adv]
            out.samples.append(Sample(ids, mask, logp, adv, stale, group.group_id))
    return out
