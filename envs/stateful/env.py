"""The ``stateful`` environment: a scenario played on a ``StatefulEnv`` class.

A scenario file (JSON) names the class, the initial state, the task text, the
check expressions (Python, over ``state``) and a turn limit. The episode ends
when the agent calls ``finish`` (terminated) or at ``max_turns`` (truncated); then
the checks run in the sandbox over the final state, each isolated in its own
``try`` so a raising check simply fails, and the reward is the fraction that
hold. Checks that exceed the sandbox limits are a broken scenario, reported as
``EnvInfraError(category=ENV)``, never as the model's failure.
"""

from __future__ import annotations

import json
import random
import secrets
from importlib import resources
from pathlib import Path
from typing import Any

import pydantic

from broker.messages import ErrorCategory
from envs.api import ResetResult, StepResult
from envs.errors import EnvInfraError, EnvSpecError, EnvStateError
from envs.registry import spec_config
from envs.sandboxed import SandboxPool, open_session, require_pool, violated, violation_name
from envs.stateful.base import StatefulEnv
from envs.stateful.library import CLASSES

_CHECK_RUNNER = """\
import json, sys
nonce = sys.stdin.readline().strip()
state = json.load(open("state.json"))
results = []
for code in json.load(open("checks.json")):
    try:
        results.append(bool(eval(code, {"state": state})))
    except Exception:
        results.append(False)
print(nonce + json.dumps(results))
"""


class Check(pydantic.BaseModel):
    """One check over the final state."""

    model_config = pydantic.ConfigDict(extra="forbid", frozen=True)

    name: str = pydantic.Field(description="what it verifies, for reports")
    code: str = pydantic.Field(
        min_length=1, description="Python expression over `state`, true when met"
    )


class Scenario(pydantic.BaseModel):
    """A stateful task: class, initial state, task text, checks."""

    model_config = pydantic.ConfigDict(extra="forbid", frozen=True)

    name: str = pydantic.Field(min_length=1, description="scenario name")
    env: str = pydantic.Field(description="StatefulEnv class name")
    task: str = pydantic.Field(min_length=1, description="task text shown to the agent")
    initial_state: dict[str, Any] = pydantic.Field(description="values of the class's STATE_FIELDS")
    checks: tuple[Check, ...] = pydantic.Field(
        min_length=1, description="checks over the final state"
    )
    max_turns: int = pydantic.Field(10, ge=1, le=200, description="turn limit (truncation)")


def builtin_scenarios() -> dict[str, Scenario]:
    found = {}
    for entry in resources.files("envs.stateful.scenarios").iterdir():
        if entry.name.endswith(".json"):
            scenario = Scenario.model_validate_json(entry.read_text())
            found[scenario.name] = scenario
    return found


class StatefulConfig(pydantic.BaseModel):
    """Configuration of the stateful environment."""

    model_config = pydantic.ConfigDict(extra="forbid", frozen=True)

    scenario: str | None = pydantic.Field(
        None, description="built-in scenario; the seed picks one if unset"
    )
    scenario_file: str | None = pydantic.Field(None, description="path of a scenario JSON file")
    check_timeout_s: float = pydantic.Field(
        5.0, gt=0, le=60, description="limit for running the checks"
    )


class StatefulScenarioEnv:
    """Plays scenarios on StatefulEnv classes; the checks run in the sandbox."""

    action_vocabulary: tuple[str, ...] | None = None
    system_prompt = "Use the tools to complete the task, then call finish."

    def __init__(
        self,
        config: StatefulConfig,
        sandbox: SandboxPool | None,
        classes: dict[str, type[StatefulEnv]] | None = None,
    ):
        self.config = config
        self.pool = require_pool(sandbox, "stateful")
        self.classes = classes or CLASSES
        if config.scenario_file:
            self.scenarios = {
                "file": Scenario.model_validate_json(Path(config.scenario_file).read_text())
            }
        else:
            self.scenarios = builtin_scenarios()
            if config.scenario is not None:
                if config.scenario not in self.scenarios:
                    raise EnvSpecError(
                        f"unknown scenario {config.scenario!r}; known: {sorted(self.scenarios)}"
                    )
                self.scenarios = {config.scenario: self.scenarios[config.scenario]}
        for scenario in self.scenarios.values():
            if scenario.env not in self.classes:
                raise EnvSpecError(
                    f"scenario {scenario.name!r} names unknown class {scenario.env!r}"
                )
        self.scenario: Scenario | None = None
        self.inner: StatefulEnv | None = None
        self.tools = self.classes[next(iter(self.scenarios.values())).env]().tools
        self.turns = 0

    async def areset(self, seed: int | None = None) -> ResetResult:
        names = sorted(self.scenarios)
        self.scenario = self.scenarios[names[random.Random(seed).randrange(len(names))]]
        self.inner = self.classes[self.scenario.env]()
        self.inner.load_state(self.scenario.initial_state)
        self.tools = self.inner.tools
        await self.inner.areset(seed)
        self.turns = 0
        return self.scenario.task, {"scenario": self.scenario.name}

    async def run_checks(self, state: dict[str, Any]) -> list[bool]:
        """Evaluate the scenario's checks over ``state`` in the sandbox."""
        assert self.scenario is not None
        nonce = secrets.token_hex(12)
        files = {
            "state.json": json.dumps(state),
            "checks.json": json.dumps([c.code for c in self.scenario.checks]),
        }
        async with open_session(self.pool) as sb:
            result = await sb.run_python(
                _CHECK_RUNNER, stdin=nonce + "\n", files=files, timeout=self.config.check_timeout_s
            )
        line = next(
            (ln for ln in reversed(result.stdout.splitlines()) if ln.startswith(nonce)), None
        )
        if violated(result) or line is None:
            why = (
                violation_name(result)
                if violated(result)
                else f"no result (exit {result.exit_code})"
            )
            raise EnvInfraError(
                f"checks of scenario {self.scenario.name!r} failed to run: {why}", ErrorCategory.ENV
            )
        results = json.loads(line[len(nonce) :])
        if not isinstance(results, list) or len(results) != len(self.scenario.checks):
            raise EnvInfraError(
                f"checks of scenario {self.scenario.name!r} returned {results!r:.100}",
                ErrorCategory.ENV,
            )
        return [bool(r) for r in results]

    async def astep(self, action: Any) -> StepResult:
        if self.inner is None or self.scenario is None:
            raise EnvStateError("stateful: step() before reset() or after the episode ended")
        obs, _, terminated, _, info = await self.inner.astep(action)
        self.turns += 1
        truncated = not terminated and self.turns >= self.scenario.max_turns
        if not (terminated or truncated):
            return obs, 0.0, False, False, info
        if truncated:
            info["truncated_by"] = "max_turns"
        results = await self.run_checks(self.inner.state_dict())
        info["checks"] = {c.name: ok for c, ok in zip(self.scenario.checks, results, strict=True)}
        self.inner = None
        return obs, sum(results) / len(results), terminated, truncated, info


@spec_config(StatefulConfig)
def make_stateful_env(sandbox: SandboxPool | None = None, **kwargs: Any) -> StatefulScenarioEnv:
    """Registry factory for ``stateful@{"scenario": name}``; kwargs are StatefulConfig fields."""
    return StatefulScenarioEnv(StatefulConfig(**kwargs), sandbox)
