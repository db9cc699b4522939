"""Small environments the worker tests register (imported in-process and by
`python -m workers --env-modules tests.workers.testenvs`).

- `wk-dialogue`: multi-turn; records what it saw and said in `TRANSCRIPTS[seed]` (one
  transcript per episode reset with that seed: a group's episodes share it);
  `step_s` makes each step sleep, `pad` lengthens observations (to keep a task in flight while a test kills things).
- `wk-raise`: its step raises (an env bug).
- `wk-hang`: its step never returns (an env hang).
- `wk-unbuildable`: passes `envs.check_spec`, but its factory raises `EnvSpecError`
  (like a codegym source name that only the worker can look up).
- `wk-overrun`: says `terminated` and would go on answering steps after it; counts them
  in `OVERRUN_STEPS[seed]` (one count per episode reset with that seed).
"""

from __future__ import annotations

import asyncio
from typing import Any

import envs
from envs import Env

# seed -> one transcript per episode reset with it: [(kind, text)], kind obs/action
TRANSCRIPTS: dict[int, list[list[tuple[str, str]]]] = {}
OVERRUN_STEPS: dict[int, list[int]] = {}  # seed -> steps each wk-overrun episode received


class Dialogue(Env):
    system_prompt = "Reply briefly."

    def __init__(self, turns: int = 3, step_s: float = 0.0, pad: int = 0) -> None:
        self.turns, self.step_s, self.pad, self.k, self.seed = turns, step_s, pad, 0, 0

    async def areset(self, *, seed: int | None = None) -> tuple[str, dict[str, Any]]:
        self.seed, self.k = seed or 0, 0
        obs = f"Hello #{self.seed}: tell me about ünïcödé {self.seed % 7}."
        self.transcript = [("obs", obs)]
        TRANSCRIPTS.setdefault(self.seed, []).append(self.transcript)
        return obs, {}

    async def astep(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        if self.step_s:
            await asyncio.sleep(self.step_s)
        self.k += 1
        obs = f"Observation {self.k}: you wrote {len(action)} characters.\n" + "." * self.pad
        self.transcript += [("action", action), ("obs", obs)]
        return obs, float(self.k), self.k >= self.turns, False, {}


class Raising(Env):
    def reset(self, *, seed: int | None = None) -> tuple[str, dict[str, Any]]:
        return "go", {}

    def step(self, action: Any) -> Any:
        raise RuntimeError("environment bug")


class Hanging(Env):
    async def areset(self, *, seed: int | None = None) -> tuple[str, dict[str, Any]]:
        return "go", {}

    async def astep(self, action: Any) -> Any:
        await asyncio.Event().wait()  # never set


def unbuildable(name: str = "x") -> Env:
    raise envs.EnvSpecError(f"unknown source {name!r} on this worker")


class Overrun:
    """GEM-shaped, without its own end tracking: it would answer steps after the end."""

    def reset(self, seed: int | None = None) -> tuple[str, dict[str, Any]]:
        self.steps = OVERRUN_STEPS.setdefault(seed or 0, [])
        self.slot = len(self.steps)
        self.steps.append(0)
        return "go", {}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        self.steps[self.slot] += 1
        return "still here", 1.0, True, False, {}


for _name, _factory in (
    ("wk-dialogue", Dialogue),
    ("wk-raise", Raising),
    ("wk-hang", Hanging),
    ("wk-unbuildable", unbuildable),
    ("wk-overrun", Overrun),
):
    if _name not in envs.registered():
        envs.register(_name, _factory)
