"""The lookup environment: the answer is the tool's observation, over two turns."""

from __future__ import annotations

import pytest

import envs
from broker.messages import ErrorCategory
from envs.errors import EnvSpecError, EnvStateError


async def test_registered_and_the_tool_reveals_the_answer() -> None:
    env = envs.make("lookup")
    assert "lookup" in envs.registered() and "?" in env.action_vocabulary
    for seed in range(20):
        key, info = await envs.areset(env, seed=seed)
        assert key == info["key"] and len(key) == 1 and key.isalpha()
        obs, reward, terminated, truncated, info = await envs.astep(env, "3")
        # protocol mode: the first action is the tool call, whatever it says
        assert (reward, terminated, truncated, info["looked_up"]) == (0.0, False, False, True)
        assert obs == info["answer"] and obs.isdigit()
        _, reward, terminated, truncated, info = await envs.astep(env, obs + "<|im_end|>")
        assert (reward, terminated, truncated, info["correct"]) == (1.0, True, False, True)
        with pytest.raises(EnvStateError):
            await envs.astep(env, "1")


async def test_the_action_vocabulary_follows_the_protocol() -> None:
    env = envs.make("lookup")
    await envs.areset(env, seed=4)
    assert env.action_vocabulary == ("?",)  # the forced call: no digit to draw on turn 1
    await envs.astep(env, "?")
    assert env.action_vocabulary == tuple("0123456789")
    await envs.areset(env, seed=5)
    assert env.action_vocabulary == ("?",)  # a reset starts the protocol again
    chooser = envs.make('lookup@{"choose": true}')
    await envs.areset(chooser, seed=4)
    assert set(chooser.action_vocabulary) == set("0123456789?")  # the agent decides
    await envs.astep(chooser, "?")
    assert set(chooser.action_vocabulary) == set("0123456789?")


async def test_the_first_observation_does_not_predict_the_answer() -> None:
    env = envs.make("lookup")
    by_key: dict[str, set[str]] = {}
    for seed in range(400):
        key, _ = await envs.areset(env, seed=seed)
        obs, *_ = await envs.astep(env, "?")
        by_key.setdefault(key, set()).add(obs)
    assert sum(len(v) >= 5 for v in by_key.values()) >= 10  # many answers per key


async def test_ignoring_the_observation_scores_about_ten_percent() -> None:
    env = envs.make("lookup")
    hits = 0
    for seed in range(1000):
        await envs.areset(env, seed=seed)
        await envs.astep(env, "?")
        hits += int((await envs.astep(env, "4"))[1])
    assert 60 < hits < 140


async def test_choose_mode_needs_the_call_before_an_answer() -> None:
    env = envs.make('lookup@{"choose": true, "max_turns": 3}')
    await envs.areset(env, seed=1)
    obs, reward, terminated, _, info = await envs.astep(env, "5")
    assert (reward, terminated, info["error"]) == (0.0, False, ErrorCategory.FORMAT)
    assert "first" in obs and not info["looked_up"]
    obs, reward, terminated, _, info = await envs.astep(
        env, '<tool_call>{"name": "lookup", "arguments": {}}</tool_call>'
    )
    assert (reward, terminated, info["looked_up"]) == (0.0, False, True)
    _, reward, terminated, _, _ = await envs.astep(env, obs)
    assert (reward, terminated) == (1.0, True)


async def test_turn_limit_truncates_and_bad_actions_are_format_errors() -> None:
    env = envs.make('lookup@{"choose": true, "max_turns": 2}')
    await envs.areset(env, seed=2)
    _, _, _, truncated, info = await envs.astep(env, "hello")
    assert not truncated and info["error"] == ErrorCategory.FORMAT
    _, reward, terminated, truncated, info = await envs.astep(env, '{"name": "other"}')
    assert (reward, terminated, truncated, info["truncated_by"]) == (0.0, False, True, "max_turns")


@pytest.mark.parametrize("spec", ['lookup@{"max_turns": 1}', 'lookup@{"keys": 3}'])
def test_bad_kwargs_are_spec_errors(spec: str) -> None:
    with pytest.raises(EnvSpecError):
        envs.make(spec)
