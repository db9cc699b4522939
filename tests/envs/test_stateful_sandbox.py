"""Stateful scenarios in a real sandbox: full solutions, partial credit, broken checks."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

import envs
from broker.messages import ErrorCategory
from envs.errors import EnvInfraError


def call(name: str, **arguments: Any) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


SOLUTIONS = {
    "inventory_restock": [
        call("add_stock", item="apple", quantity=6),
        call("place_order", customer="Ada", item="pear", quantity=3),
    ],
    "calendar_standup": [
        call("cancel_event", title="lunch"),
        call("add_event", title="standup", day="monday", start=12, end=13),
    ],
    "bank_transfer": [
        call("transfer", source="alice", target="bob", amount=50),
        call("deposit", account="carol", amount=20),
    ],
}


@pytest.mark.bwrap
@pytest.mark.parametrize("scenario", sorted(SOLUTIONS))
async def test_scenario_solved_scores_one(bwrap_pool: Any, scenario: str) -> None:
    env = envs.make(f'stateful@{{"scenario": "{scenario}"}}', sandbox=bwrap_pool)
    obs, info = await envs.areset(env, seed=0)
    assert info["scenario"] == scenario and "finish" in obs
    for action in SOLUTIONS[scenario]:
        obs, reward, terminated, truncated, _ = await envs.astep(env, action)
        assert not obs.startswith("Error") and (reward, terminated, truncated) == (
            0.0,
            False,
            False,
        )
    _, reward, terminated, truncated, info = await envs.astep(env, call("finish"))
    assert (reward, terminated, truncated) == (1.0, True, False)
    assert all(info["checks"].values())


@pytest.mark.bwrap
async def test_partial_credit_and_truncation(bwrap_pool: Any) -> None:
    env = envs.make('stateful@{"scenario": "bank_transfer"}', sandbox=bwrap_pool)
    await envs.areset(env, seed=0)
    await envs.astep(env, call("deposit", account="carol", amount=20))
    _, reward, terminated, _, info = await envs.astep(env, call("finish"))
    assert info["checks"] == {
        "alice paid": False,
        "bob received": False,
        "carol deposited": True,
        "total is 150": True,
    }
    assert reward == 0.5 and terminated
    await envs.areset(env, seed=0)
    for _ in range(5):
        assert not (await envs.astep(env, "no tools"))[3]
    _, reward, terminated, truncated, info = await envs.astep(env, "still no tools")
    assert (terminated, truncated, info["truncated_by"], info["error"]) == (
        False,
        True,
        "max_turns",
        ErrorCategory.FORMAT,
    )
    assert reward == 0.0 and not any(info["checks"].values())


def _scenario(tmp_path: Path, checks: list[dict[str, str]]) -> str:
    path = tmp_path / "s.json"
    path.write_text(
        json.dumps(
            {
                "name": "custom",
                "env": "Bank",
                "task": "Deposit 1 into a.",
                "max_turns": 3,
                "initial_state": {"accounts": {"a": 0}, "log": []},
                "checks": checks,
            }
        )
    )
    return json.dumps({"scenario_file": str(path), "check_timeout_s": 2})


@pytest.mark.bwrap
async def test_raising_check_fails_and_hanging_checks_are_infra(
    bwrap_pool: Any, tmp_path: Path
) -> None:
    checks = [
        {"name": "ok", "code": "state['accounts']['a'] == 1"},
        {"name": "raises", "code": "1/0"},
    ]
    env = envs.make("stateful@" + _scenario(tmp_path, checks), sandbox=bwrap_pool)
    await envs.areset(env, seed=0)
    _, reward, _, _, info = await envs.astep(
        env, call("deposit", account="a", amount=1) + call("finish")
    )
    assert reward == 0.5 and info["checks"] == {"ok": True, "raises": False}
    # an endless loop in constant memory (a growing list would race the memory limit)
    hanging = [{"name": "hangs", "code": "any(False for _ in iter(int, 1))"}]
    env = envs.make("stateful@" + _scenario(tmp_path, hanging), sandbox=bwrap_pool)
    await envs.areset(env, seed=0)
    with pytest.raises(EnvInfraError) as err:
        await envs.astep(env, call("finish"))
    assert err.value.category == ErrorCategory.ENV
