"""Groups of real conversations for the `show` tests, tokenized as a worker does.

Each turn's prompt-side tokens come from the tiny model's chat template through
`workers.tokens.ChatCodec` (the first prompt, then the diff after each completion),
and each completion is the encoded text plus the end-of-turn token, so a correct
decode gives back exactly the texts listed here.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from broker.messages import (
    ErrorCategory,
    FinishReason,
    Task,
    Trajectory,
    TrajectoryGroup,
    Truncation,
    Turn,
)
from workers.tokens import ChatCodec

SYSTEM = "You answer arithmetic."


@dataclass(frozen=True)
class Step:
    """One turn as text: what the environment said, what the model answered, the reward."""

    observation: str
    completion: str
    reward: float


@dataclass(frozen=True)
class Episode:
    steps: tuple[Step, ...]
    finish: FinishReason = FinishReason.TERMINATED
    error: ErrorCategory = ErrorCategory.NONE
    error_detail: str = ""
    truncation: Truncation | None = None


def trajectory(codec: ChatCodec, episode: Episode, index: int, version: int) -> Trajectory:
    turns, previous = [], None
    for k, step in enumerate(episode.steps):
        if previous is None:
            prompt = codec.initial_prompt(step.observation, SYSTEM, None)
        else:
            prompt = codec.next_prompt(previous, step.observation)
        completion = [*codec.encode(step.completion), codec.stop_token_ids[0]]
        last = k == len(episode.steps) - 1
        turns.append(
            Turn(
                prompt_ids=prompt,
                completion_ids=completion,
                logprobs=np.full(len(completion), -0.5),
                weight_version=version + k,
                reward=step.reward,
                terminated=last and episode.finish is FinishReason.TERMINATED,
                truncated=last and episode.finish is FinishReason.TRUNCATED,
            )
        )
        previous = completion
    return Trajectory(
        turns=tuple(turns),
        finish_reason=episode.finish,
        error=episode.error,
        error_detail=episode.error_detail,
        sample_index=index,
        truncation=episode.truncation,
    )


def make_group(
    codec: ChatCodec, group_id: str, episodes: list[Episode], version: int = 3
) -> TrajectoryGroup:
    task = Task(
        task_id=group_id,
        env_spec="toy@{}",
        group_size=len(episodes),
        seed=11,
        policy_version=version,
    )
    trajs = tuple(trajectory(codec, e, i, version) for i, e in enumerate(episodes))
    return TrajectoryGroup(group_id=group_id, task=task, trajectories=trajs, worker_id="w-show")


def arithmetic(tag: str) -> list[Episode]:
    """Three episodes whose returns are 1, 0.5 and 0 (GRPO: +1.225, 0, -1.225)."""
    return [
        Episode(
            (
                Step(f"{tag} what is 2+2?", f"{tag} ep0 says 5", 0.0),
                Step(f"{tag} wrong, try again", f"{tag} ep0 says 4", 1.0),
            )
        ),
        Episode((Step(f"{tag} what is 2+2?", f"{tag} ep1 says four-ish", 0.5),)),
        Episode(
            (
                Step(
                    f"{tag} what is 2+2?", f"{tag} ep2 <script>document.title='pwned'</script>", 0.0
                ),
            ),
            finish=FinishReason.ERROR,
            error=ErrorCategory.FORMAT,
            error_detail="no answer found",
        ),
    ]
