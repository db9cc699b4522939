"""The code environment in a real sandbox: every grade, every verification mode,
multi-turn feedback, hostile code contained, infrastructure failures kept distinct."""

from __future__ import annotations

import json
from typing import Any

import pytest

import envs
from envs.errors import EnvInfraError

ADD = "def add(a, b):\n    return a + b\n"
SUM_TWO = "a, b = map(int, input().split())\nprint(a + b)\n"
FORK_BOMB = (
    "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
)
ENDLESS = "while True:\n    pass\n"
MEMORY_BOMB = "x = []\nwhile True:\n    x.append(bytearray(50 * 1024 * 1024))\n"


def _code_env(pool: Any, **kwargs: Any) -> Any:
    return envs.make("code@" + json.dumps({"timeout_s": 3, **kwargs}), sandbox=pool)


async def _attempt(env: Any, code: str, seed: int = 0) -> tuple:
    await envs.areset(env, seed=seed)
    return await envs.astep(env, f"Here:\n```python\n{code}```")


@pytest.mark.bwrap
async def test_coderl_grades_on_stdio(bwrap_pool: Any) -> None:
    env = _code_env(bwrap_pool, problem_ids=["sum-two"], reward="coderl")
    cases = {
        SUM_TWO: (1.0, "passed"),
        "print(sum(map(int, input().split()))": (-1.0, "compile_error"),
        "raise RuntimeError('boom')\n": (-0.6, "runtime_error"),
        "print(3)\n": (-0.3, "failed"),
    }
    for code, (reward, outcome) in cases.items():
        _, got, terminated, truncated, info = await _attempt(env, code)
        assert (got, info["outcome"], terminated, truncated) == (reward, outcome, True, False), code
    assert (await _attempt(env, "print(3)\n"))[4]["tests_passed"] == 1  # "1 2" -> 3 passes one test


@pytest.mark.bwrap
async def test_assert_mode_rejects_early_exit_and_counts_fraction(bwrap_pool: Any) -> None:
    env = _code_env(bwrap_pool, problem_ids=["add-function"], reward="fraction")
    assert (await _attempt(env, ADD))[1] == 1.0
    assert (await _attempt(env, "def add(a, b):\n    return int(a) + int(b)\n"))[
        1
    ] == pytest.approx(2 / 3)
    _, reward, _, _, info = await _attempt(env, "import os\nos._exit(0)\n")
    assert reward == 0.0 and info["outcome"] == "runtime_error"


@pytest.mark.bwrap
async def test_execution_mode(bwrap_pool: Any) -> None:
    env = _code_env(bwrap_pool, problem_ids=["print-squares"], reward="coderl")
    assert (await _attempt(env, "for i in range(1, 11):\n    print(i * i)\n"))[1] == 1.0
    assert (await _attempt(env, "print(undefined_name)\n"))[1] == -0.6


@pytest.mark.bwrap
async def test_multi_turn_feedback_hides_expected_unless_configured(bwrap_pool: Any) -> None:
    env = _code_env(bwrap_pool, problem_ids=["sum-two"], max_attempts=2)
    obs, reward, terminated, truncated, info = await _attempt(env, "print(3)\n")
    assert (reward, terminated, truncated, info["attempt"]) == (0.0, False, False, 1)
    assert "1/3 tests passed" in obs and "Test 2: wrong output" in obs and "expected" not in obs
    obs, reward, terminated, truncated, _ = await envs.astep(env, SUM_TWO)
    assert (obs, reward, terminated, truncated) == ("All tests passed.", 1.0, True, False)
    await _attempt(env, "print(3)\n")
    _, reward, terminated, truncated, info = await envs.astep(env, "print(4)\n")
    assert (reward, terminated, truncated, info["truncated_by"]) == (
        0.0,
        False,
        True,
        "max_attempts",
    )
    revealing = _code_env(bwrap_pool, problem_ids=["sum-two"], max_attempts=2, reveal_expected=True)
    obs = (await _attempt(revealing, "print(3)\n"))[0]
    assert "expected: '0\\n'" in obs and "got: '3\\n'" in obs


@pytest.mark.slow
@pytest.mark.bwrap
@pytest.mark.parametrize(
    "hostile", [FORK_BOMB, ENDLESS, MEMORY_BOMB], ids=["fork", "loop", "memory"]
)
async def test_hostile_code_is_contained(bwrap_pool: Any, hostile: str) -> None:
    env = _code_env(bwrap_pool, problem_ids=["sum-two"], reward="coderl", timeout_s=2)
    _, reward, terminated, _, info = await _attempt(env, hostile)
    assert reward == -0.6 and terminated and info["outcome"] == "runtime_error"
    assert (await _attempt(env, SUM_TWO))[1] == 1.0  # the environment keeps working


@pytest.mark.bwrap
async def test_sandbox_failure_is_infra_error_not_low_reward(bwrap_pool: Any) -> None:
    env = _code_env(bwrap_pool, problem_ids=["sum-two"])
    await envs.areset(env, seed=0)
    await bwrap_pool.close()  # a real failure of the sandbox itself: the pool is gone
    with pytest.raises(EnvInfraError) as err:
        await envs.astep(env, SUM_TWO)
    assert err.value.category == "sandbox"


@pytest.mark.docker
@pytest.mark.slow
async def test_code_env_on_docker(docker_pool: Any) -> None:
    env = _code_env(docker_pool, problem_ids=["fibonacci"], reward="coderl")
    fib = "def fib(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n"
    assert (await _attempt(env, fib))[1] == 1.0
    assert (await _attempt(env, ENDLESS.replace("while", "def fib(n):\n  while")))[1] == -0.6
    assert (await _attempt(env, FORK_BOMB))[1] == -0.6
