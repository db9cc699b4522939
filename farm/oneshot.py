"""`farm eval` and `farm filter`: the one-machine stack without a learner, for one command.

The stack is `farm up`'s (a private Redis, the CPU policy server on ``--model``, the
workers) less the learner; once every process is ready, ``python -m learner evaluate``
(or ``filter``) runs against it with the remaining arguments, its table printed straight
to the terminal, and the stack stops when it exits. Its exit status is the command's.
"""

from __future__ import annotations

import asyncio
import dataclasses
import sys

from farm.config import FarmConfig
from farm.console import Console
from farm.stack import build_stack, prepare, run_section
from farm.supervisor import RestartPolicy, Supervisor
from launch.settings import render_flags


async def run_oneshot(cfg: FarmConfig, console: Console, command: str, args: list[str]) -> int:
    """Bring the stack up without its learner, run `learner <command> args`, stop; its status."""
    model, tasks = await prepare(cfg, console.line)
    stack = build_stack(cfg, model, tasks)
    specs = [s for s in stack.specs if s.name != "learner"]
    stack = dataclasses.replace(stack, specs=tuple(specs))
    supervisor = Supervisor(stack.specs, console.line, RestartPolicy(max_restarts=cfg.restart_max))
    supervisor.install_signal_handlers()
    # the stack's run section renders only what differs from the shared defaults (the
    # command's log level stays its own unless the farm was given one)
    argv = [
        sys.executable,
        "-m",
        "learner",
        command,
        *render_flags(run_section(cfg, stack.redis_url)),
        *args,
    ]
    status: list[int] = []

    async def one_command(stop: asyncio.Event) -> None:
        proc = await asyncio.create_subprocess_exec(*argv)
        try:
            status.append(await proc.wait())
        finally:
            if proc.returncode is None:  # the farm is stopping under it
                proc.terminate()
                await proc.wait()
        supervisor.request_stop(f"{command} finished")

    try:
        await supervisor.run(one_command)
    finally:
        console.close()
    return status[0] if status else 1
