"""`bench learner --model DIR --env SPEC`: the batches are the environment's own prompts."""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path

import numpy as np

from bench.learner import env_shape, make_groups
from envs.api import areset
from envs.registry import make
from workers.tokens import ChatCodec, load_tokenizer


def test_env_batches_carry_the_prompts_a_worker_would_send(tiny_model_dir: Path) -> None:
    args = argparse.Namespace(completion_tokens=5, group_size=4, groups_per_batch=3)
    shape = env_shape(tiny_model_dir, "toy", args)
    codec = ChatCodec(load_tokenizer(str(tiny_model_dir)))
    for seed, prompt in enumerate(shape.prompts):
        env = make("toy")
        observation, _ = asyncio.run(areset(env, seed=seed))
        assert list(prompt) == codec.initial_prompt(observation, env.system_prompt, env.tools)
    groups = make_groups(6, shape)
    assert [len(g.trajectories) for g in groups] == [4] * 6
    turn = groups[4].trajectories[2].turns[0]
    assert np.array_equal(turn.prompt_ids, shape.prompts[4 % 3])
    assert len(turn.completion_ids) == 5 and max(turn.completion_ids) < shape.vocab
    assert "3 groups x 4 x (" in shape.describe()
