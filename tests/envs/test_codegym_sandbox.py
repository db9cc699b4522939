"""CodeGym in a real sandbox: episodes, transactional rollback, the loader, hostile code."""

from __future__ import annotations

import json
import shutil
from importlib import resources
from pathlib import Path
from typing import Any

import pytest

import envs
from broker.messages import ErrorCategory
from envs.codegym import library, load_directory
from envs.errors import EnvInfraError, EnvStateError


def call(name: str, **arguments: Any) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


def _env(pool: Any, name: str, **kwargs: Any) -> Any:
    return envs.make("codegym@" + json.dumps({"env": name, **kwargs}), sandbox=pool)


@pytest.mark.bwrap
async def test_episode_tools_and_done(bwrap_pool: Any) -> None:
    env = _env(bwrap_pool, "max_subarray", config_index=0)
    assert env.tools and env.system_prompt  # known before the first reset
    try:
        obs, info = await envs.areset(env, seed=0)
        assert "subarray" in obs and info["config_index"] == 0
        assert {t["function"]["name"] for t in env.tools} == {
            "Observe",
            "GetElement",
            "Add",
            "Max",
            "Done",
        }
        assert (await envs.astep(env, call("Observe")))[0] == "The array has 9 elements."
        codegym = '<|FunctionCallBegin|>[{"name": "GetElement", "parameters": {"index": 3}}]<|FunctionCallEnd|>'
        assert (await envs.astep(env, codegym))[0] == "4"
        obs, reward, terminated, truncated, info = await envs.astep(
            env, call("GetElement", index=99)
        )
        assert (
            obs.startswith("Error: GetElement failed: IndexError")
            and info["rolled_back"]
            and not terminated
        )
        obs, _, _, _, info = await envs.astep(env, call("Teleport"))
        assert info["error"] == ErrorCategory.FORMAT and "unknown tool" in obs
        obs, _, _, _, info = await envs.astep(env, call("Add", a=1))
        assert info["error"] == ErrorCategory.FORMAT and "missing" in obs
        obs, _, _, _, info = await envs.astep(env, "I think it is 6")
        assert info["error"] == ErrorCategory.FORMAT
        obs, reward, terminated, truncated, _ = await envs.astep(env, call("Done", answer=6))
        assert (obs, reward, terminated, truncated) == ("Correct.", 1.0, True, False)
        with pytest.raises(EnvStateError):
            await envs.astep(env, call("Observe"))
        await envs.areset(env, seed=0)
        assert (await envs.astep(env, call("Done", answer="5")))[1:3] == (0.0, True)
    finally:
        await envs.aclose(env)


@pytest.mark.bwrap
async def test_timed_out_tool_rolls_back_state(bwrap_pool: Any) -> None:
    env = _env(bwrap_pool, "expression_sum", config_index=0, tool_timeout_s=1.0)
    try:
        await envs.areset(env, seed=0)
        assert (await envs.astep(env, call("Calculate", expression="3*4")))[0] == "12"
        obs, reward, terminated, _, info = await envs.astep(
            env, call("Calculate", expression="9**9**9**9")
        )
        assert "limit" in obs and "state is unchanged" in obs and info["rolled_back"]
        assert (reward, terminated) == (0.0, False)
        assert (await envs.astep(env, call("History")))[
            0
        ] == "3*4"  # the timed-out call left no trace
        several = call("Calculate", expression="10-7") + call("Calculate", expression="2**5")
        assert (await envs.astep(env, several))[0] == "3\n32"
        assert (await envs.astep(env, call("History")))[0] == "3*4;10-7;2**5"
        assert (await envs.astep(env, call("Done", answer="47")))[1] == 1.0
    finally:
        await envs.aclose(env)


HOSTILE_INIT = {
    "fork.py": "import os\n        while True:\n            try:\n                os.fork()\n            except OSError:\n                pass",
    "loop.py": "while True:\n            pass",
    "memory.py": "x = []\n        while True:\n            x.append(bytearray(50 * 1024 * 1024))",
}


def _user_env(body: str, tool_body: str = "return 'ok'", answer: str = "1") -> str:
    return f'''from codegym_runtime import CodeGymEnv, tool


class UserEnv(CodeGymEnv):
    """User environment."""

    CONFIGS = [{{"n": 1}}]

    def __init__(self, n: int):
        self.n = n
        {body}

    def get_ref_answer(self):
        return {answer}

    @tool
    def Poke(self) -> str:
        """Poke it."""
        {tool_body}

    def solve(self):
        return self.Done(str(self.n))
'''


@pytest.mark.slow
@pytest.mark.bwrap
async def test_loader_admits_only_envs_that_prove_themselves(
    bwrap_pool: Any, tmp_path: Path
) -> None:
    for entry in resources.files("envs.codegym.library").iterdir():
        if entry.name.endswith(".py") and not entry.name.startswith("_"):
            (tmp_path / f"user_{entry.name}").write_text(entry.read_text())
    (tmp_path / "wrong_oracle.py").write_text(_user_env("pass", answer="2"))
    (tmp_path / "syntax.py").write_text("def broken(:\n")
    (tmp_path / "spins.py").write_text(_user_env("pass", tool_body="while True:\n            pass"))
    for name, body in HOSTILE_INIT.items():
        (tmp_path / name).write_text(_user_env(body))
    report = await load_directory(tmp_path, bwrap_pool, limit_s=2.0)
    builtins = [
        f"user_{name}"
        for name in (
            "binary_search",
            "expression_sum",
            "max_subarray",
            "pair_count",
            "word_frequency",
        )
    ]
    assert sorted(report.admitted) == sorted([*builtins, "spins"])
    assert "did not reach a correct Done" in report.rejected["wrong_oracle.py"]
    assert "does not parse" in report.rejected["syntax.py"]
    for name in HOSTILE_INIT:
        assert "does not instantiate" in report.rejected[name], report.rejected[name]
    assert "user_max_subarray" in library()
    # An admitted environment whose tool hangs: the call times out, the env keeps working.
    env = _env(bwrap_pool, "spins", tool_timeout_s=1.0)
    try:
        await envs.areset(env, seed=0)
        obs, _, terminated, _, info = await envs.astep(env, call("Poke"))
        assert info["rolled_back"] and not terminated and "limit" in obs
        assert (await envs.astep(env, call("Done", answer="1")))[1:3] == (1.0, True)
    finally:
        await envs.aclose(env)
    shutil.rmtree(tmp_path)


@pytest.mark.bwrap
@pytest.mark.parametrize("name", ["pair_count", "binary_search", "word_frequency"])
async def test_other_builtins_reset_and_answer(bwrap_pool: Any, name: str) -> None:
    env = _env(bwrap_pool, name, config_index=0)
    answers = {"pair_count": "3", "binary_search": "4", "word_frequency": "the"}
    try:
        obs, _ = await envs.areset(env, seed=1)
        assert obs and env.tools
        assert (await envs.astep(env, call("Observe")))[0]
        assert (await envs.astep(env, call("Done", answer=answers[name])))[1:4] == (
            1.0,
            True,
            False,
        )
    finally:
        await envs.aclose(env)


@pytest.mark.bwrap
async def test_sandbox_failure_is_infra_error(bwrap_pool: Any) -> None:
    env = _env(bwrap_pool, "pair_count", config_index=0)
    await envs.areset(env, seed=0)
    assert (await envs.astep(env, call("Done", answer="3")))[1] == 1.0
    await bwrap_pool.close()  # the sandbox itself fails: no session can be had
    with pytest.raises(EnvInfraError) as err:
        await envs.areset(env, seed=0)
    assert err.value.category == ErrorCategory.SANDBOX
    await envs.aclose(env)  # closing after an infrastructure failure does not raise


HOSTILE_TOOLS = {
    "fork_tool": "import os\n        while True:\n            try:\n                os.fork()\n            except OSError:\n                pass",
    "memory_tool": "x = []\n        while True:\n            x.append(bytearray(50 * 1024 * 1024))",
}


@pytest.mark.slow
@pytest.mark.bwrap
async def test_hostile_tools_roll_back_and_env_keeps_working(
    bwrap_pool: Any, tmp_path: Path
) -> None:
    for name, body in HOSTILE_TOOLS.items():
        (tmp_path / f"{name}.py").write_text(_user_env("pass", tool_body=body))
    report = await load_directory(tmp_path, bwrap_pool, limit_s=2.0)
    assert sorted(report.admitted) == sorted(HOSTILE_TOOLS)  # solve() never calls the bomb
    for name in HOSTILE_TOOLS:
        env = _env(bwrap_pool, name, tool_timeout_s=1.5)
        try:
            await envs.areset(env, seed=0)
            obs, reward, terminated, _, info = await envs.astep(env, call("Poke"))
            assert info["rolled_back"] and (reward, terminated) == (0.0, False), obs
            assert (await envs.astep(env, call("Done", answer="1")))[1:3] == (1.0, True)
        finally:
            await envs.aclose(env)


@pytest.mark.docker
@pytest.mark.slow
async def test_codegym_rollback_on_docker(docker_pool: Any) -> None:
    env = _env(docker_pool, "expression_sum", config_index=1, tool_timeout_s=1.5)
    try:
        await envs.areset(env, seed=0)
        assert (await envs.astep(env, call("Calculate", expression="(1+2)*(3+4)")))[0] == "21"
        assert (await envs.astep(env, call("Calculate", expression="9**9**9**9")))[4]["rolled_back"]
        assert (await envs.astep(env, call("History")))[0] == "(1+2)*(3+4)"
        assert (await envs.astep(env, call("Done", answer=35)))[1:3] == (1.0, True)
    finally:
        await envs.aclose(env)
