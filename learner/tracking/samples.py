"""A step's sample table: a few trajectories of the batch, one row each, rendered.

Rows are taken round-robin over the batch's groups (episode 0 of every group, then
episode 1, ...), so one table shows several tasks; trajectories that were not trained
(an infrastructure error, a zero-variance or dropped group) are shown too, with their
error category and no advantage. What a row says was trained is the learner's loss
mask for that trajectory, read back from the batch's samples by turn.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from broker.messages import Trajectory, TrajectoryGroup
from learner.batch import Sample
from learner.tracking.render import Decode, as_text, render_turns

COLUMNS = (
    "step",
    "group",
    "episode",
    "env",
    "reward",  # the episode's summed turn rewards, before shaping
    "advantage",  # mean over its trained turns (None: not trained)
    "trained_tokens",
    "finish",
    "error",  # error category ("none" when the episode ran clean)
    "task_version",  # policy version when the task was issued
    "weight_versions",  # each turn's weight version, comma-separated
    "conversation",  # learner.tracking.render.as_text
)


@dataclass(frozen=True)
class SampleTable:
    """The rows one step logs; each row holds one value per column of `COLUMNS`."""

    step: int  # the learner step the batch trained
    rows: list[tuple[object, ...]]

    @property
    def columns(self) -> tuple[str, ...]:
        return COLUMNS


def turn_training(
    trajectory: Trajectory, samples: Sequence[Sample]
) -> tuple[list[np.ndarray], list[np.ndarray]] | None:
    """Per turn, the loss mask and advantages of its completion tokens (None: untrained)."""
    if not samples:
        return None
    masks = [np.zeros(len(t.completion_ids), np.float32) for t in trajectory.turns]
    advs = [np.zeros(len(t.completion_ids), np.float32) for t in trajectory.turns]
    for sample in samples:
        if sample.turn_index is None:
            continue
        for k in np.unique(sample.turn_index[sample.turn_index >= 0]).tolist():
            where = sample.turn_index == k
            n = int(where.sum())  # a segment's first token carries no turn: align at the end
            masks[k][-n:] = sample.loss_mask[where]
            advs[k][-n:] = sample.advantages[where]
    return masks, advs


def _picks(groups: Sequence[TrajectoryGroup], rows: int) -> list[tuple[TrajectoryGroup, int]]:
    longest = max((len(g.trajectories) for g in groups), default=0)
    order = [(g, i) for i in range(longest) for g in groups if i < len(g.trajectories)]
    return order[:rows]


def _row(
    step: int,
    group: TrajectoryGroup,
    trajectory: Trajectory,
    samples: Sequence[Sample],
    decode: Decode,
) -> tuple[object, ...]:
    training = turn_training(trajectory, samples)
    if training is None:  # not trained: no token carries a loss
        masks = [np.zeros(len(t.completion_ids), np.float32) for t in trajectory.turns]
        turns = render_turns(trajectory, decode, masks)
    else:
        turns = render_turns(trajectory, decode, *training)
    trained = [t.advantage for t in turns if t.advantage is not None]
    return (
        step,
        group.group_id,
        trajectory.sample_index,
        group.task.env_spec,
        float(sum(t.reward for t in trajectory.turns)),
        float(np.mean(trained)) if trained else None,
        sum(t.trained_tokens for t in turns),
        str(trajectory.finish_reason),
        str(trajectory.error),
        group.task.policy_version,
        ",".join(str(t.weight_version) for t in trajectory.turns),
        as_text(turns),
    )


def sample_table(
    step: int,
    groups: Sequence[TrajectoryGroup],
    samples: Sequence[Sample],
    rows: int,
    decode: Decode,
) -> SampleTable:
    """Up to `rows` trajectories of the batch as table rows."""
    by_episode: dict[tuple[str, int], list[Sample]] = defaultdict(list)
    for sample in samples:
        by_episode[(sample.group_id, sample.episode)].append(sample)
    out = []
    for group, i in _picks(groups, rows):
        trajectory = group.trajectories[i]
        mine = by_episode.get((group.group_id, trajectory.sample_index), [])
        out.append(_row(step, group, trajectory, mine, decode))
    return SampleTable(step, out)
