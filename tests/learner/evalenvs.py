"""An environment with a known pass rate per task, for the eval and filter tests (imported
by `python -m workers --env-modules tests.learner.evalenvs`).

`ev-rate@{"passes": m, "of": n}`: episode j reset with a given seed in this process (j
counted from 0) is rewarded 1 when j mod n < m, else 0, whatever the model says; so a task
run with n samples in one round passes exactly m of them (pass rate m/n), and a round run
again, or on another worker after a crash, passes the same number. `step_s` makes its step
sleep (to keep a task in flight while a test kills its worker).
"""

from __future__ import annotations

import asyncio
import collections
from typing import Any

import envs
from envs import Env

_EPISODES: collections.Counter[tuple[int, int, int]] = collections.Counter()


class Rate(Env):
    def __init__(self, passes: int = 0, of: int = 1, step_s: float = 0.0) -> None:
        if not 0 <= passes <= of:
            raise ValueError("ev-rate needs 0 <= passes <= of")
        self.passes, self.of, self.step_s, self.reward = passes, of, step_s, 0.0

    async def areset(self, *, seed: int | None = None) -> tuple[str, dict[str, Any]]:
        key = (seed or 0, self.passes, self.of)
        j = _EPISODES[key]
        _EPISODES[key] += 1
        self.reward = 1.0 if j % self.of < self.passes else 0.0
        return f"task {seed}", {}

    async def astep(self, action: Any) -> tuple[str, float, bool, bool, dict[str, Any]]:
        if self.step_s:
            await asyncio.sleep(self.step_s)
        return "", self.reward, True, False, {}


if "ev-rate" not in envs.registered():
    envs.register("ev-rate", Rate)
