"""A tiny role started through launch.runner, for the runner's process tests.

`python -m tests.launch.role [--fail] [--token T] [--redis-url URL]`: prints READY,
then waits for the stop event (exit 0) or, with --fail, lets a component task raise.
"""

from __future__ import annotations

import asyncio
import sys
from typing import ClassVar

from pydantic import Field, SecretStr

from launch.runner import Role, RoleContext, start
from launch.settings import LogLevel, RoleConfig


class ProbeConfig(RoleConfig):
    role: ClassVar[str] = "probe"

    redis_url: str = Field("redis://127.0.0.1:6379/0", description="a URL to mask")
    token: SecretStr | None = Field(None, description="a secret to mask")
    fail: bool = Field(False, description="a component task raises")
    log_level: LogLevel = Field("INFO", description="log level")


async def _component() -> None:
    await asyncio.sleep(0.2)
    raise RuntimeError("component broke")


async def _main(ctx: RoleContext[ProbeConfig]) -> int:
    if ctx.config.fail:
        ctx.tasks.create_task(_component(), name="component")
    print("READY", flush=True)
    await ctx.stop.wait()
    print("stopping", flush=True)
    return 0


ROLE = Role("probe", ProbeConfig, _main, "runner probe", metrics_port=lambda c: 0)

if __name__ == "__main__":
    sys.exit(start(ROLE))
