"""The broker benchmarks' workload: trajectory groups of a given size, and the read count.

`bench broker` and its `--cluster` rows (`bench._broker_cluster`) publish the same
groups: 8 trajectories of one turn, 64 prompt tokens and `tokens` completion tokens.
"""

from __future__ import annotations

import numpy as np

from broker.messages import Task, Trajectory, TrajectoryGroup, Turn

READ_COUNT = 8  # entries per consumer read, as the learner reads at groups_per_batch=8


def make_group(tokens: int, index: int) -> TrajectoryGroup:
    rng = np.random.default_rng(index)
    task = Task(f"b{index}", "toy@{}", 8, index, 0)
    trajs = tuple(
        Trajectory(
            (
                Turn(
                    rng.integers(0, 50_000, 64),
                    rng.integers(0, 50_000, tokens),
                    -rng.random(tokens, dtype=np.float32),
                    0,
                    1.0,
                    True,
                    False,
                ),
            ),
            "terminated",
            sample_index=i,
        )
        for i in range(8)
    )
    return TrajectoryGroup(task.task_id, task, trajs, "bench")
