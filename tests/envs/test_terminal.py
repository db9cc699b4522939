"""The ``terminal`` env on a real bwrap sandbox: each built-in task is solved by a
scripted model through the tools (background state between calls), scores 0 when the
model does nothing, and exposes its tools as OpenAI schemas."""

from __future__ import annotations

import json
from typing import Any

import pytest

import envs
from envs.errors import EnvSpecError, EnvStateError
from envs.terminal import TASKS

# the calls a model would make to solve each task, in order; submit follows at once, so the
# checks must wait for a server that is not listening yet
SOLUTIONS: dict[str, list[tuple[str, dict[str, Any]]]] = {
    "serve-file": [
        ("shell", {"command": "python3 -m http.server 8000 --bind 127.0.0.1 >/dev/null 2>&1 &"}),
    ],
    "fix-and-serve": [
        ("edit_file", {"path": "app.py", "old": 'b"ko"', "new": 'b"ok"'}),
        ("shell", {"command": "python3 app.py 8001 2>/dev/null &"}),
    ],
    "keep-ticking": [("shell", {"command": "bash ticker.sh &"})],
}


def call(name: str, arguments: dict[str, Any]) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


async def play(env: Any, seed: int, calls: list[tuple[str, dict[str, Any]]]) -> float:
    await envs.areset(env, seed=seed)
    for name, arguments in calls:
        obs, reward, done, _, info = await envs.astep(env, call(name, arguments))
        assert not done and "error" not in info, obs
    obs, reward, done, _, _ = await envs.astep(env, call("submit", {}))
    assert done, obs
    return reward


@pytest.mark.bwrap
@pytest.mark.parametrize("task", sorted(TASKS))
async def test_each_task_is_solved_and_unsolved(bwrap_pool: Any, task: str) -> None:
    env = envs.make(f'terminal@{{"tasks": ["{task}"]}}', sandbox=bwrap_pool)
    try:
        assert await play(env, 0, SOLUTIONS[task]) == 1.0
        assert await play(env, 1, []) == 0.0  # a fresh session: nothing left running
    finally:
        await envs.aclose(env)


@pytest.mark.bwrap
async def test_a_late_ticker_still_scores(bwrap_pool: Any) -> None:
    """What a loaded host does to a running ticker: its first lines come late. The check used
    to count lines in a fixed 1 s window and scored such a ticker 0."""
    env = envs.make('terminal@{"tasks": ["keep-ticking"]}', sandbox=bwrap_pool)
    try:
        late = [("shell", {"command": "(sleep 1.5; exec bash ticker.sh) >/dev/null 2>&1 &"})]
        assert await play(env, 0, late) == 1.0
    finally:
        await envs.aclose(env)


@pytest.mark.bwrap
async def test_tools_answer_errors_as_text(bwrap_pool: Any) -> None:
    env = envs.make('terminal@{"tasks": ["fix-and-serve"]}', sandbox=bwrap_pool)
    try:
        names = {t["function"]["name"] for t in env.tools}
        assert names == {"shell", "read_file", "write_file", "edit_file", "list_dir", "submit"}
        await envs.areset(env, seed=0)
        obs, *_ = await envs.astep(env, call("read_file", {"path": "nope.txt"}))
        assert obs.startswith("Error:") and "No such file" in obs
        obs, *_ = await envs.astep(env, call("read_file", {"path": "../x"}))
        assert obs.startswith("Error:") and "outside" in obs
        obs, *_ = await envs.astep(env, call("list_dir", {}))
        assert obs == "app.py"
        obs, *_ = await envs.astep(env, call("shell", {"command": "exit 3"}))
        assert obs.endswith("[exit 3]"), obs
    finally:
        await envs.aclose(env)


def test_bad_specs_are_refused() -> None:
    with pytest.raises(EnvSpecError, match="unknown tasks"):
        envs.make('terminal@{"tasks": ["nope"]}', sandbox=object())
    with pytest.raises(EnvSpecError, match="unknown tasks"):
        envs.make('terminal@{"tasks": []}', sandbox=object())
    with pytest.raises(EnvSpecError, match="sandbox"):
        envs.make("terminal")


async def test_a_tool_before_reset_is_a_state_error() -> None:
    import sandbox  # an unstarted pool: no session may be opened

    env = envs.make("terminal", sandbox=sandbox.SandboxPool(sandbox.SandboxConfig(backend="bwrap")))
    with pytest.raises(EnvStateError, match="before reset"):
        await env.shell("ls")
