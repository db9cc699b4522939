"""Message factories and a task consumer for broker tests."""

from __future__ import annotations

import numpy as np

from broker.consumer import Consumer, ConsumerConfig
from broker.keys import WORKERS_GROUP, RunKeys
from broker.messages import Task, Trajectory, TrajectoryGroup, Turn


def task_consumer(redis, keys: RunKeys, name: str, **config) -> Consumer:
    """A consumer of `keys.tasks` in the workers' group, as a worker builds one."""
    cfg = ConsumerConfig(group=WORKERS_GROUP, consumer=name, **config)
    return Consumer(redis, keys, [keys.tasks], cfg, expect=Task)


def make_task(task_id: str, group_size: int = 2, version: int = 0) -> Task:
    return Task(
        task_id=task_id, env_spec="toy@{}", group_size=group_size, seed=7, policy_version=version
    )


def make_group(
    task_id: str, tokens: int = 4, group_size: int = 2, version: int = 0
) -> TrajectoryGroup:
    task = make_task(task_id, group_size, version)
    rng = np.random.default_rng(abs(hash(task_id)) % 2**32)
    trajs = tuple(
        Trajectory(
            turns=(
                Turn(
                    prompt_ids=rng.integers(0, 256, 3),
                    completion_ids=rng.integers(0, 256, tokens),
                    logprobs=-rng.random(tokens),
                    weight_version=version,
                    reward=float(i),
                    terminated=True,
                    truncated=False,
                ),
            ),
            finish_reason="terminated",
            sample_index=i,
        )
        for i in range(group_size)
    )
    return TrajectoryGroup(group_id=task_id, task=task, trajectories=trajs, worker_id="w-test")
