"""From trajectory groups to training sequences: filtering, shaping, advantages, assembly.

`prepare_batch` decides which groups of a batch are trained: groups whose
infrastructure failed are not (counted), nor groups with an episode that timed
out before its first action (a hung reset or first inference call is not the
model's failure: counted apart); groups older than `max_staleness`, or sampled
by weights newer than the learner's (discarded by a resume), are trained with
the behaviour correction or dropped (counted either way); zero-variance groups
of the group-relative estimators are skipped by default (counted). Rewards are
shaped (DAPO's soft overlong punishment, a KL reward penalty) before the
advantages. It then turns each kept trajectory into one sequence: for every
turn, ``prompt_ids`` (loss mask 0) followed by ``completion_ids`` (loss mask 1,
with the behaviour logprobs and the turn's advantage), as broker/messages.py
documents; a trajectory with ``segment_start`` turns (an agent that rewrote its
history) becomes one sequence per segment, since such a turn's prompt does not
extend the tokens before it. No torch here: sequences are numpy arrays, collated by the trainer."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from broker.messages import (
    ErrorCategory,
    FinishReason,
    Sampling,
    Trajectory,
    TrajectoryGroup,
    Truncation,
)
from learner.algorithms import (
    AdvantageRules,
    compute_advantages,
    episode_return,
    overlong_penalty,
)
from learner.config import BatchRules, Overlong

# (group_id, sample_index) -> {turn: the penalty on each of its completion tokens} (a KL
# reward penalty). A turn's array may lack its first token (a sequence's position 0, which
# nothing scores): it covers the turn's last tokens, and the missing one has penalty 0.
TokenPenalties = Mapping[tuple[str, int], Mapping[int, np.ndarray]]


@dataclass(frozen=True)
class Sample:
    """One trajectory as a training sequence; all arrays have the sequence's length."""

    input_ids: np.ndarray  # int64 tokens
    loss_mask: np.ndarray  # float32, 1 on completion tokens
    behaviour_logp: np.ndarray  # float32, rollout logprob on completion tokens, 0 elsewhere
    advantages: np.ndarray  # float32, the token's turn advantage on completion tokens
    # int32: the token's distribution, a row of `samplings`; -1 on prompt tokens (plain model)
    sampling_index: np.ndarray
    stale: bool  # older than max_staleness (or from discarded weights), trained corrected
    group_id: str
    episode: int = 0  # the trajectory's sample_index in its group
    turn_index: np.ndarray | None = None  # int32: the turn of each completion token, -1 elsewhere
    turn_rewards: np.ndarray | None = None  # float64, each turn's reward after overlong shaping
    # float64: a per-token reward penalty (KL reward) on completion tokens, 0 elsewhere
    token_penalty: np.ndarray | None = None
    # the episode was truncated (a limit, not the environment, ended it) and this is its last
    # sequence: GAE bootstraps from the value of the state after its last token
    bootstrap: bool = False
    prox_logp: np.ndarray | None = None  # proximal logprobs, set by the trainer before updating
    ref_logp: np.ndarray | None = None  # reference-model logprobs (KL loss), set by the trainer
    old_values: np.ndarray | None = None  # critic values before the update (ppo)
    returns: np.ndarray | None = None  # GAE returns, the critic's targets (ppo)
    samplings: tuple[Sampling, ...] = ()  # the distributions the turns were sampled from


def advantage_rules(rules: BatchRules) -> AdvantageRules:
    """The part of the batch rules that turns returns into advantages."""
    return AdvantageRules(rules.algorithm, rules.gamma, rules.grpo_scale_by_std, rules.grpo_std)


def overlong(trajectory: Trajectory) -> bool:
    """Whether a length limit cut the episode: the context or an agent's token budget ended it,
    or one of its completions stopped at max tokens instead of a stop token."""
    if trajectory.truncation in (Truncation.CONTEXT, Truncation.TOKENS):
        return True
    return any(turn.cut for turn in trajectory.turns)


@dataclass
class PreparedBatch:
    """Sequences to train plus what happened to every group of the batch."""

    samples: list[Sample] = field(default_factory=list)
    trained_groups: list[str] = field(default_factory=list)  # ids whose samples are in `samples`
    infra_failed: list[str] = field(default_factory=list)
    no_action_timeouts: list[str] = field(default_factory=list)  # hung before the first action
    zero_variance: list[str] = field(default_factory=list)
    zero_variance_returns: list[float] = field(default_factory=list)  # each one's common return
    overlong: int = 0  # trajectories cut by a length limit (masked or punished by the rule)
    dropped_stale: list[str] = field(default_factory=list)
    corrected_stale: list[str] = field(default_factory=list)
    staleness: list[int] = field(default_factory=list)  # per group not infra-failed; < 0: discarded
    episode_returns: list[float] = field(default_factory=list)  # every episode of those groups
    advantages: list[float] = field(default_factory=list)  # one per trained turn
    reward_kl: float | None = None  # mean per-token KL of a KL reward penalty (kl_mode reward)

    @property
    def num_tokens(self) -> int:
        return int(sum(s.loss_mask.sum() for s in self.samples))


def samplings_of(trajectory: Trajectory) -> tuple[tuple[Sampling, ...], list[int]]:
    """The distinct distributions of a trajectory's turns, and each turn's row among them."""
    table: dict[Sampling, int] = {}
    rows = [table.setdefault(turn.sampling, len(table)) for turn in trajectory.turns]
    return tuple(table), rows


def assemble(
    trajectory: Trajectory, turn_advantages: Sequence[float | np.ndarray]
) -> tuple[np.ndarray, ...]:
    """(input_ids, loss_mask, behaviour_logp, advantages, sampling_index, turn_index) of one
    trajectory; `sampling_index` points into `samplings_of(trajectory)[0]`. Each turn's
    advantage is one number for all its completion tokens, or one per token."""
    ids: list[np.ndarray] = []
    mask: list[np.ndarray] = []
    logp: list[np.ndarray] = []
    adv: list[np.ndarray] = []
    dist: list[np.ndarray] = []
    turn_index: list[np.ndarray] = []
    _, rows = samplings_of(trajectory)
    for k, (turn, a) in enumerate(zip(trajectory.turns, turn_advantages, strict=True)):
        n_p, n_c = len(turn.prompt_ids), len(turn.completion_ids)
        ids += [turn.prompt_ids, turn.completion_ids]
        mask += [np.zeros(n_p, np.float32), np.ones(n_c, np.float32)]
        logp += [np.zeros(n_p, np.float32), turn.logprobs.astype(np.float32)]
        adv += [np.zeros(n_p, np.float32), np.broadcast_to(np.float32(a), n_c).astype(np.float32)]
        dist += [np.full(n_p, -1, np.int32), np.full(n_c, rows[k], np.int32)]
        turn_index += [np.full(n_p, -1, np.int32), np.full(n_c, k, np.int32)]
    out = (
        np.concatenate(ids).astype(np.int64),
        np.concatenate(mask),
        np.concatenate(logp),
        np.concatenate(adv),
        np.concatenate(dist),
        np.concatenate(turn_index),
    )
    # Position 0 has no preceding token to predict it from, so it can never carry loss.
    out[1][:1] = 0.0
    out[5][:1] = -1  # its turn index: no turn trains it
    return out


def no_action_timeout(trajectory: Trajectory) -> bool:
    """A timeout before the first action: the infrastructure hung, the model did nothing."""
    return trajectory.error is ErrorCategory.TIMEOUT and not trajectory.turns


def _stale_action(staleness: int, rules: BatchRules) -> str:
    # Negative: the tokens came from weights a resume discarded; they are not fresh.
    if 0 <= staleness <= rules.max_staleness:
        return "fresh"
    return "drop" if rules.drop_stale else "correct"


def truncated(trajectory: Trajectory) -> bool:
    """Whether a limit cut the episode (max turns, context, wall time, a token budget, the
    environment's truncated=True): the task would have gone on, so a value bootstraps it."""
    return trajectory.finish_reason is FinishReason.TRUNCATED


def turn_token_penalties(
    trajectory: Trajectory, found: Mapping[int, np.ndarray] | None
) -> list[np.ndarray]:
    """Each turn's per-completion-token penalty (float64, the turn's length; 0 where none)."""
    out = []
    for k, turn in enumerate(trajectory.turns):
        full = np.zeros(len(turn.completion_ids), np.float64)
        got = (found or {}).get(k)
        if got is not None and len(got):
            full[len(full) - len(got) :] = got
        out.append(full)
    return out


def shaped_rewards(
    trajectory: Trajectory, rules: BatchRules, penalty: np.ndarray | None = None
) -> np.ndarray:
    """Each turn's reward after the soft overlong punishment, less `penalty` (per turn: the
    sum of a per-token KL penalty over the turn's tokens)."""
    rewards = np.array([t.reward for t in trajectory.turns], dtype=np.float64)
    if penalty is not None:
        rewards -= penalty
    if rules.overlong is Overlong.SOFT and len(rewards):
        if overlong(trajectory):
            rewards[-1] -= rules.overlong_penalty
        else:
            length = sum(len(t.completion_ids) for t in trajectory.turns)
            rewards[-1] += overlong_penalty(
                length,
                rules.overlong_max_tokens or 0,
                rules.overlong_buffer,
                rules.overlong_penalty,
            )
    return rewards


def _screen(
    groups: Sequence[TrajectoryGroup],
    rules: BatchRules,
    version: int,
    out: PreparedBatch,
    judge_staleness: bool,
) -> list[tuple[TrajectoryGroup, bool]]:
    """Groups that may train, each with its stale flag; the others are counted in `out`."""
    candidates: list[tuple[TrajectoryGroup, bool]] = []
    for group in groups:
        if group.infra_failed:
            out.infra_failed.append(group.group_id)
            continue
        if any(no_action_timeout(t) for t in group.trajectories):
            out.no_action_timeouts.append(group.group_id)
            continue
        staleness = version - group.min_weight_version
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
    return candidates


def prepare_batch(
    groups: Sequence[TrajectoryGroup],
    rules: BatchRules,
    version: int,
    penalties: TokenPenalties | None = None,
    judge_staleness: bool = True,
) -> PreparedBatch:
    """Filter the groups of one batch, shape rewards, and assemble the sequences to train.

    `penalties` is a per-token reward penalty (KL): a token's return counts the penalties
    from that token on. `judge_staleness=False` trains every group as fresh (a replay: its
    versions are not this run's); staleness is still measured.
    """
    out = PreparedBatch()
    candidates = _screen(groups, rules, version, out, judge_staleness)
    penalties = penalties or {}
    per_token = [
        [
            turn_token_penalties(tr, penalties.get((g.group_id, tr.sample_index)))
            for tr in g.trajectories
        ]
        for g, _ in candidates
    ]
    rewards = [
        [
            shaped_rewards(tr, rules, np.array([p.sum() for p in turns]))
            for tr, turns in zip(g.trajectories, g_pen, strict=True)
        ]
        for (g, _), g_pen in zip(candidates, per_token, strict=True)
    ]
    tokens = [
        [[len(t.completion_ids) for t in tr.turns] for tr in g.trajectories] for g, _ in candidates
    ]
    offsets = [[[np.cumsum(p) - p for p in turns] for turns in g] for g in per_token]
    advs = compute_advantages(rewards, advantage_rules(rules), tokens, offsets)
    for (group, stale), g_pen, g_off, group_adv, zero_var in zip(
        candidates, per_token, offsets, advs.values, advs.zero_variance, strict=True
    ):
        if zero_var:
            out.zero_variance.append(group.group_id)
            out.zero_variance_returns.append(_group_return(group, rules.gamma))
            if rules.skip_zero_variance:
                continue
        out.trained_groups.append(group.group_id)
        for trajectory, turn_pen, turn_off, turn_adv in zip(
            group.trajectories, g_pen, g_off, group_adv, strict=True
        ):
            token_adv = [a + advs.token_scale * o for a, o in zip(turn_adv, turn_off, strict=True)]
            samples = _samples(
                trajectory,
                Scored(shaped_rewards(trajectory, rules), token_adv, turn_pen),
                stale,
                group.group_id,
                rules=rules,
                out=out,
            )
            if samples:
                out.advantages += [float(a) for a in turn_adv]
                out.samples += samples
    return out


def _group_return(group: TrajectoryGroup, gamma: float) -> float:
    """A group's mean episode return: for a zero-variance group, what every sample scored."""
    returns = [episode_return([t.reward for t in tr.turns], gamma) for tr in group.trajectories]
    return float(np.mean(returns)) if returns else 0.0


@dataclass(frozen=True)
class Scored:
    """What the learner computed for one trajectory's turns."""

    rewards: np.ndarray  # each turn's reward after overlong shaping (no KL penalty)
    advantages: list[np.ndarray]  # per turn, one advantage per completion token
    penalties: list[np.ndarray]  # per turn, the per-token reward penalty (KL)


def _samples(
    trajectory: Trajectory,
    scored: Scored,
    stale: bool,
    group_id: str,
    *,
    rules: BatchRules,
    out: PreparedBatch,
) -> list[Sample]:
    if not trajectory.turns:
        return []
    if overlong(trajectory):
        out.overlong += 1
        if rules.overlong is Overlong.MASK:
            return []  # overlong filtering: its reward still counted in the baseline
    samples = []
    table, _ = samplings_of(trajectory)
    arrays = assemble(trajectory, scored.advantages)
    for ids, mask, logp, adv, dist, turn_index in split_segments(trajectory, arrays):
        if mask.sum() > 0:
            sample = Sample(
                input_ids=ids,
                loss_mask=mask,
                behaviour_logp=logp,
                advantages=adv,
                sampling_index=dist,
                stale=stale,
                group_id=group_id,
                episode=trajectory.sample_index,
                turn_index=turn_index,
                turn_rewards=scored.rewards,
                token_penalty=_laid_out(turn_index, scored.penalties),
                samplings=table,
            )
            samples.append(sample)
    if samples and truncated(trajectory):
        samples[-1] = dataclasses.replace(samples[-1], bootstrap=True)
    return samples


def _laid_out(turn_index: np.ndarray, per_turn: Sequence[np.ndarray]) -> np.ndarray:
    """Per-turn token values in a sequence's coordinates: turn k's on the positions whose turn
    index is k (its last tokens, where position 0 took its first), 0 elsewhere."""
    out = np.zeros(len(turn_index), np.float64)
    for k, values in enumerate(per_turn):
        where = np.flatnonzero(turn_index == k)
        if len(where):
            out[where] = values[len(values) - len(where) :]
    return out


def split_segments(
    trajectory: Trajectory, arrays: tuple[np.ndarray, ...]
) -> list[tuple[np.ndarray, ...]]:
    """`assemble`'s arrays cut before every `segment_start` turn: each segment is a sequence
    of its own (its first token has no loss, as any sequence's); turn indices stay the
    trajectory's."""
    cuts, offset = [0], 0
    for turn in trajectory.turns:
        if turn.segment_start and offset:
            cuts.append(offset)
        offset += len(turn.prompt_ids) + len(turn.completion_ids)
    if len(cuts) == 1:
        return [arrays]
    parts = []
    for a, b in zip(cuts, [*cuts[1:], offset], strict=True):
        ids, mask, logp, adv, dist, turn_index = (x[a:b].copy() for x in arrays)
        mask[:1], turn_index[:1] = 0.0, -1
        parts.append((ids, mask, logp, adv, dist, turn_index))
    return parts


def filter_reason(group: TrajectoryGroup, rules: BatchRules) -> str | None:
    """Why `group` would train nothing ("infra", "no_action", "zero_variance"), or None.

    Dynamic sampling (DAPO) uses it to fill a batch with groups that carry signal;
    staleness is left to `prepare_batch`, which knows the step that trains the group.
    """
    if group.infra_failed:
        return "infra"
    if any(no_action_timeout(t) for t in group.trajectories):
        return "no_action"
    if rules.algorithm.group_relative and rules.skip_zero_variance:
        returns = {
            episode_return(shaped_rewards(t, rules).tolist(), rules.gamma)
            for t in group.trajectories
        }
        if len(returns) <= 1:
            return "zero_variance"
    return None
