"""The view of one trajectory group that both renderers draw: text, marks and numbers.

`build_view` turns a `TrajectoryGroup` into plain frozen records: per episode its
turns in order, each with the prompt-side and completion tokens decoded into spans
that say whether the learner trains them. Groups carry no advantages on the wire,
so they come from the learner's own functions (`learner.batch.shaped_rewards`,
`learner.algorithms.compute_advantages`), with the run's `BatchRules`; the loss mask
comes from `learner.batch.assemble` and `split_segments`, so a mark here is exactly a
token the learner would put loss on. Estimators that look past the group (`rebn`
normalises over the whole batch) are computed over this group alone, and the KL
reward penalty (it needs the reference model) is left out: the view says so.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from broker.messages import Sampling, Trajectory, TrajectoryGroup
from learner.algorithms import compute_advantages, episode_return
from learner.batch import (
    advantage_rules,
    assemble,
    filter_reason,
    overlong,
    shaped_rewards,
    split_segments,
)
from learner.config import Algorithm, BatchRules, Overlong
from learner.spans import Decoder, Span, spans


def describe_sampling(sampling: Sampling) -> str:
    """``T=1``, then only the truncations in effect: ``top-k 5``, ``top-p 0.9``, ``min-p 0.1``,
    ``10 allowed``."""
    parts = [f"T={sampling.temperature:g}"]
    if sampling.top_k:
        parts.append(f"top-k {sampling.top_k}")
    if sampling.top_p < 1.0:
        parts.append(f"top-p {sampling.top_p:g}")
    if sampling.min_p > 0.0:
        parts.append(f"min-p {sampling.min_p:g}")
    if sampling.allowed_token_ids is not None:
        parts.append(f"{len(sampling.allowed_token_ids)} allowed")
    return " ".join(parts)


def ids_only(ids: Sequence[int]) -> str:
    """The decoder without a tokenizer: the ids themselves."""
    return " ".join(str(int(i)) for i in ids)


@dataclass(frozen=True)
class TurnView:
    """One model turn."""

    index: int  # position in the episode, from 0
    prompt: tuple[Span, ...]  # prompt-side tokens added before the turn (never trained)
    completion: tuple[Span, ...]  # the sampled tokens after the reasoning: the env's answer
    reward: float  # the environment's reward for this turn
    shaped_reward: float  # after the learner's reward shaping (overlong)
    advantage: float  # the learner's advantage for every completion token of the turn
    weight_version: int  # oldest weight version behind the completion
    sampling: str  # the distribution the completion was drawn from, e.g. "T=1 top-k 5"
    mean_logprob: float | None  # mean behaviour logprob of the completion (None: empty)
    segment_start: bool  # the prompt starts a new sequence (an agent rewrote its history)
    terminated: bool
    truncated: bool
    cut: bool  # the completion stopped at a length limit, not a stop token
    # the sampled tokens the reasoning parser split off (Turn.reasoning_tokens), first
    reasoning: tuple[Span, ...] = ()


@dataclass(frozen=True)
class EpisodeView:
    """One trajectory of the group."""

    sample_index: int
    outcome: str  # finish reason, with the truncation cause
    error: str  # error category ("none" when none)
    error_detail: str
    episode_return: float  # discounted return of the shaped rewards
    trained: bool  # False: the learner trains no token of it (no turns, overlong masked)
    turns: tuple[TurnView, ...]
    timings: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class GroupView:
    """The group, ready to draw."""

    group_id: str
    entry_id: str
    origin: str  # stream key or archive directory
    env_spec: str
    worker_id: str
    created_at: float  # unix seconds
    policy_version: int  # the learner's version when the task was issued
    weight_versions: tuple[int, ...]  # distinct versions behind its completions, sorted
    algorithm: str
    gamma: float
    skipped: str | None  # why the learner trains none of it (infra, no_action, zero_variance)
    tokenizer: str | None  # where the decoding tokenizer came from (None: ids shown)
    notes: tuple[str, ...]  # caveats on the numbers
    episodes: tuple[EpisodeView, ...]


def _loss_mask(trajectory: Trajectory, turn_adv: np.ndarray, rules: BatchRules) -> np.ndarray:
    if not trajectory.turns or (rules.overlong is Overlong.MASK and overlong(trajectory)):
        width = sum(len(t.prompt_ids) + len(t.completion_ids) for t in trajectory.turns)
        return np.zeros(width, np.float32)
    parts = split_segments(trajectory, assemble(trajectory, turn_adv))
    return np.concatenate([part[1] for part in parts])


def _episode(
    trajectory: Trajectory,
    shaped: np.ndarray,
    turn_adv: np.ndarray,
    rules: BatchRules,
    decode: Decoder,
) -> EpisodeView:
    mask = _loss_mask(trajectory, turn_adv, rules)
    turns, offset = [], 0
    for k, turn in enumerate(trajectory.turns):
        n_p, n_c = len(turn.prompt_ids), len(turn.completion_ids)
        p_mask, c_mask = mask[offset : offset + n_p], mask[offset + n_p : offset + n_p + n_c]
        offset += n_p + n_c
        r = turn.reasoning_tokens
        turns.append(
            TurnView(
                index=k,
                prompt=spans(turn.prompt_ids, p_mask, decode),
                reasoning=spans(turn.completion_ids[:r], c_mask[:r], decode) if r else (),
                completion=spans(turn.completion_ids[r:], c_mask[r:], decode),
                reward=turn.reward,
                shaped_reward=float(shaped[k]),
                advantage=float(turn_adv[k]),
                weight_version=turn.weight_version,
                sampling=describe_sampling(turn.sampling),
                mean_logprob=float(turn.logprobs.mean()) if n_c else None,
                segment_start=turn.segment_start,
                terminated=turn.terminated,
                truncated=turn.truncated,
                cut=turn.cut,
            )
        )
    return EpisodeView(
        sample_index=trajectory.sample_index,
        outcome=trajectory.outcome,
        error=trajectory.error.value,
        error_detail=trajectory.error_detail,
        episode_return=episode_return(shaped.tolist(), rules.gamma),
        trained=bool(mask.any()),
        turns=tuple(turns),
        timings=dict(trajectory.timings),
    )


def _notes(rules: BatchRules) -> tuple[str, ...]:
    notes = ["advantages computed here as the learner does (the group carries none)"]
    if rules.algorithm is Algorithm.REBN:
        notes.append("rebn normalises over a whole batch: here over this group alone")
    if rules.algorithm is Algorithm.PPO:
        notes.append("ppo advantages come from the critic: shown as 0")
    notes.append("a KL reward penalty, if the run uses one, is not applied")
    return tuple(notes)


def build_view(
    group: TrajectoryGroup,
    entry_id: str,
    origin: str,
    rules: BatchRules,
    *,
    decode: Decoder = ids_only,
    tokenizer: str | None = None,
) -> GroupView:
    """The view of `group` as the learner configured by `rules` would train it."""
    shaped = [shaped_rewards(t, rules) for t in group.trajectories]
    advantages = compute_advantages([shaped], advantage_rules(rules)).values[0]
    episodes = tuple(
        _episode(t, s, a, rules, decode)
        for t, s, a in zip(group.trajectories, shaped, advantages, strict=True)
    )
    versions = {turn.weight_version for t in group.trajectories for turn in t.turns}
    return GroupView(
        group_id=group.group_id,
        entry_id=entry_id,
        origin=origin,
        env_spec=group.task.env_spec,
        worker_id=group.worker_id,
        created_at=group.created_at,
        policy_version=group.task.policy_version,
        weight_versions=tuple(sorted(versions)),
        algorithm=rules.algorithm.value,
        gamma=rules.gamma,
        skipped=filter_reason(group, rules),
        tokenizer=tokenizer,
        notes=_notes(rules),
        episodes=episodes,
    )
