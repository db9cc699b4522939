"""Factories for learner tests: deterministic trajectory groups, fed straight into Redis."""

from __future__ import annotations

import hashlib

import numpy as np

from broker.messages import (
    DEFAULT_SAMPLING,
    ErrorCategory,
    Sampling,
    Task,
    Trajectory,
    TrajectoryGroup,
    Turn,
)


def make_group(
    group_id: str,
    rewards: list[float] | None = None,
    *,
    version: int = 0,
    turns: int = 1,
    vocab: int = 256,
    error: ErrorCategory = ErrorCategory.NONE,
    sampling: Sampling = DEFAULT_SAMPLING,
) -> TrajectoryGroup:
    """A group whose tokens and behaviour logprobs depend only on `group_id` (completions drawn
    from `sampling`'s allowed set when it has one)."""
    drawable = sampling.allowed_token_ids if sampling.allowed_token_ids is not None else vocab
    rewards = [0.0, 1.0, 0.0, 1.0] if rewards is None else rewards
    seed = int.from_bytes(hashlib.sha256(group_id.encode()).digest()[:4], "little")
    rng = np.random.default_rng(seed)
    task = Task(
        task_id=group_id,
        env_spec="toy@{}",
        group_size=len(rewards),
        seed=seed,
        policy_version=version,
        issued_at=0.0,
    )
    trajectories = []
    for i, reward in enumerate(rewards):
        episode = tuple(
            Turn(
                prompt_ids=rng.integers(0, vocab, 5),
                completion_ids=rng.choice(drawable, 3),
                logprobs=-rng.uniform(3.0, 7.0, 3),
                weight_version=version,
                reward=reward if t == turns - 1 else 0.0,
                terminated=t == turns - 1,
                truncated=False,
                sampling=sampling,
            )
            for t in range(turns)
        )
        trajectories.append(
            Trajectory(
                turns=episode,
                finish_reason="terminated",
                error=error if i == 0 else ErrorCategory.NONE,
                sample_index=i,
            )
        )
    return TrajectoryGroup(
        group_id=group_id,
        task=task,
        trajectories=tuple(trajectories),
        worker_id="w-test",
        created_at=0.0,
    )
