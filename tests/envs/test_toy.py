"""The toy environment: fixed seeds, reward rule, termination, difficulty levels."""

from __future__ import annotations

import pytest

import envs
from envs.errors import EnvStateError
from envs.toy import DIGITS


def _solve(obs: str) -> str:
    # Evaluate the shown expression; %10 covers the last-digit levels.
    return str(eval(obs, {"__builtins__": {}}) % 10)


@pytest.mark.parametrize("difficulty", [0, 1, 2, 3])
async def test_correct_answer_rewarded_and_terminates(difficulty: int) -> None:
    env = envs.make(f'toy@{{"difficulty": {difficulty}}}')
    assert env.action_vocabulary == DIGITS
    for seed in range(30):
        obs, info = await envs.areset(env, seed=seed)
        assert info["difficulty"] == difficulty and len(obs) <= 5
        _, reward, terminated, truncated, info = await envs.astep(env, _solve(obs))
        assert (reward, terminated, truncated, info["correct"]) == (1.0, True, False, True)


async def test_wrong_answer_scores_zero_and_random_policy_about_ten_percent() -> None:
    env = envs.make("toy")
    obs, _ = await envs.areset(env, seed=5)
    wrong = str((int(obs) + 1) % 10)
    _, reward, terminated, truncated, info = await envs.astep(env, wrong)
    assert (reward, terminated, truncated) == (0.0, True, False) and info["answer"] == obs
    hits = 0
    for seed in range(1000):
        await envs.areset(env, seed=seed)
        hits += int((await envs.astep(env, "3"))[1])
    assert 60 < hits < 140


async def test_seeds_are_deterministic_and_varied() -> None:
    env = envs.make('toy@{"difficulty": 1}')
    first = [(await envs.areset(env, seed=s))[0] for s in range(20)]
    again = [(await envs.areset(env, seed=s))[0] for s in range(20)]
    assert first == again and len(set(first)) > 5
    assert all(0 <= int(_solve(o)) <= 9 and eval(o) == int(_solve(o)) for o in first)


async def test_step_out_of_order_raises_state_error() -> None:
    env = envs.make("toy")
    with pytest.raises(EnvStateError):
        await envs.astep(env, "1")
    await envs.areset(env, seed=0)
    await envs.astep(env, "1")
    with pytest.raises(EnvStateError):
        await envs.astep(env, "1")


async def test_answer_whitespace_tolerated_but_extra_text_wrong() -> None:
    env = envs.make('toy@{"instructions": true}')
    assert env.system_prompt and "digit" in env.system_prompt
    obs, _ = await envs.areset(env, seed=3)
    assert (await envs.astep(env, f" {obs}\n"))[1] == 1.0
    await envs.areset(env, seed=3)
    assert (await envs.astep(env, f"{obs}<|im_end|>"))[1] == 1.0
    await envs.areset(env, seed=3)
    assert (await envs.astep(env, f"<|im_end|>{obs}x<|im_end|>"))[1] == 0.0
    await envs.areset(env, seed=3)
    assert (await envs.astep(env, f"{obs}{obs}"))[1] == 0.0
