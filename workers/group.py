"""One task → one `TrajectoryGroup`: its `n` episodes run concurrently, faults retried.

Invariants:
- every episode of a task resets its environment with `task.seed`, so the group's episodes
  share one prompt, and samples with seeds of its own (`Task.sampling_seed(i, turn)`); the
  group holds exactly `n` trajectories, in index order, and is built only once every episode
  has finished;
- an episode cut short by an infrastructure fault that may be transient (inference
  unreachable, the sandbox failing) is re-run from scratch, with a fresh environment and
  the same seeds, up to `retries` times; if it still fails, its trajectory carries the
  infrastructure category, so `TrajectoryGroup.infra_failed` is true and the learner
  never mistakes it for the model's failure;
- an `EnvSpecError` (the task itself cannot run) is not retried: it cancels the other
  episodes and leaves `run_group` in an exception group, for the worker to dead-letter.
"""

from __future__ import annotations

import asyncio
import dataclasses

from broker.messages import ErrorCategory, Task, Trajectory, TrajectoryGroup
from workers import metrics
from workers.config import EpisodeSettings
from workers.episode import EpisodeContext, run_episode

RETRYABLE = frozenset({ErrorCategory.INFERENCE, ErrorCategory.SANDBOX})


async def run_group(
    ctx: EpisodeContext,
    cfg: EpisodeSettings,
    task: Task,
    *,
    max_turns: int,
    retries: int,
    worker_id: str,
) -> TrajectoryGroup:
    """Run every episode of `task` concurrently and return the complete group."""
    n = task.group_size
    results: list[Trajectory | None] = [None] * n
    async with asyncio.TaskGroup() as tg:
        for i in range(n):
            tg.create_task(
                _episode_with_retries(
                    ctx, cfg, task, i, max_turns=max_turns, retries=retries, results=results
                ),
                name=f"episode:{task.task_id}/{i}",
            )
    trajectories = tuple(t for t in results if t is not None)
    return TrajectoryGroup(
        group_id=task.task_id, task=task, trajectories=trajectories, worker_id=worker_id
    )


async def _episode_with_retries(
    ctx: EpisodeContext,
    cfg: EpisodeSettings,
    task: Task,
    index: int,
    *,
    max_turns: int,
    retries: int,
    results: list[Trajectory | None],
) -> None:
    attempt = 0
    while True:
        traj = await run_episode(ctx, cfg, task, index, max_turns)
        if traj.error not in RETRYABLE or attempt >= retries:
            break
        attempt += 1
        metrics.RETRIES.labels(category=traj.error.value).inc()
        await asyncio.sleep(min(0.2 * 2**attempt, 5.0))  # let a failing server/sandbox recover
    if attempt:
        traj = dataclasses.replace(traj, timings={**traj.timings, "attempts": float(attempt + 1)})
    results[index] = traj
