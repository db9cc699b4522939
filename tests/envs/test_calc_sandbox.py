"""calc with its calculator in a real sandbox: the same results as the worker's calculator,
refusals as error observations, a broken sandbox as an infrastructure error."""

from __future__ import annotations

from typing import Any

import pytest

import envs
from broker.messages import ErrorCategory
from envs.calc import answer_of
from envs.errors import EnvInfraError, EnvSpecError, EnvStateError
from envs.parsing import Action, parse_with

CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "%s"}}\n</tool_call>'
SPEC = 'calc@{"calculator": "sandbox"}'
EXPRESSIONS = ["347*28", "10/4", "10/2", "2^10", "-(3-5)*2", "2**-1", "1/3", "7//2 + 7%2"]
REFUSED = ["__import__('os').system('id')", "9**9**9", "1/0", "", "x" * 300]


def hermes(text: str) -> Action:
    return Action(text, parse_with("hermes", text))


async def _start(pool: Any, seed: int = 3) -> tuple[Any, str, int]:
    env = envs.make(SPEC, sandbox=pool)
    _, info = await envs.areset(env, seed=seed)
    return env, info["problem"], answer_of(tuple(map(int, info["problem"].split("*"))), "mul3x2")


def test_the_sandbox_calculator_needs_a_pool() -> None:
    with pytest.raises(EnvSpecError, match="sandbox"):
        envs.make(SPEC)


@pytest.mark.bwrap
async def test_an_episode_calls_the_sandbox_and_answers(bwrap_pool: Any) -> None:
    env, problem, answer = await _start(bwrap_pool)
    obs, reward, terminated, _, info = await envs.astep(env, hermes(CALL % problem))
    assert (obs[0]["content"], reward, terminated) == (str(answer), 0.0, False)
    assert obs[0]["tool_call_id"] and "error" not in info
    _, reward, terminated, _, info = await envs.astep(env, hermes(f"It is {answer}."))
    assert (reward, terminated, info["correct"], info["used_tool"]) == (1.0, True, True, True)
    with pytest.raises(EnvStateError, match="astep"):
        env.step(hermes("1"))  # the sync path cannot reach the sandbox


@pytest.mark.bwrap
async def test_the_sandbox_gives_what_the_worker_gives(bwrap_pool: Any) -> None:
    for expression in EXPRESSIONS + REFUSED:
        results = []
        for env in (envs.make(SPEC, sandbox=bwrap_pool), envs.make("calc")):
            await envs.areset(env, seed=1)
            obs, _, terminated, _, info = await envs.astep(env, hermes(CALL % expression))
            results.append((obs[0]["content"], info.get("error"), terminated))
        assert results[0] == results[1], expression
        refused = expression in REFUSED
        assert results[0][0].startswith("Error:") is refused, (expression, results[0])
        assert (results[0][1] == ErrorCategory.FORMAT) is refused


@pytest.mark.bwrap
async def test_a_refused_call_does_not_count_as_using_the_tool(bwrap_pool: Any) -> None:
    env, _, answer = await _start(bwrap_pool)
    await envs.astep(env, hermes(CALL % "__import__('os')"))
    _, reward, terminated, _, info = await envs.astep(env, hermes(str(answer)))
    assert (reward, terminated, info["used_tool"]) == (0.0, True, False)


@pytest.mark.bwrap
async def test_a_broken_sandbox_is_an_infrastructure_error(bwrap_pool: Any) -> None:
    env, problem, _ = await _start(bwrap_pool)
    await bwrap_pool.close()  # a real fault: the pool is gone under a running episode
    with pytest.raises(EnvInfraError) as caught:
        await envs.astep(env, hermes(CALL % problem))
    assert caught.value.category is ErrorCategory.SANDBOX
