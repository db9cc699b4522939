"""`slow-toy`: the toy task whose step first waits `step_s`, like a sandbox or tool call.

The compose stack test mounts this file into the worker containers and loads it with
``--env-modules compose_env`` (the workers' plugin mechanism). Episodes that wait on
I/O make the rollout side the bottleneck, which is what scaling workers out relieves:
with the toy task's instant steps the learner would be the bottleneck and extra
workers would change nothing.
"""

from __future__ import annotations

import asyncio

import envs
from envs.api import StepResult
from envs.toy import ToyEnv


class SlowToy(ToyEnv):
    """ToyEnv (difficulty 0) with an awaited pause before each step."""

    def __init__(self, step_s: float = 1.0) -> None:
        super().__init__()
        self.step_s = step_s

    async def astep(self, action: object) -> StepResult:
        await asyncio.sleep(self.step_s)
        return self.step(action)


if "slow-toy" not in envs.registered():
    envs.register("slow-toy", SlowToy)
