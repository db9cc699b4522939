"""The one start-up path of every role process: config, logging, metrics, signals, TaskGroup.

`start(role, argv)` does, in this order and the same way for every role:

1. parse the command line (flags derived from the role's config, grouped by
   section, plus the role's own arguments such as subcommands) and resolve the config
   (flags > environment > TOML, `launch.settings.resolve`); a bad config prints one
   message listing every problem and exits 2, before any heavy import;
2. set up logging (one format, the role's ``log_level``) and log the resolved config
   as one JSON line (``{"event": "config", ...}``) with every secret masked;
3. run the role's synchronous preparation (rlimits, torch threads, heavy imports: until
   step 4 a SIGTERM ends the process at once, so a role stopped while it starts does not
   first finish starting) and start its Prometheus ``/metrics`` endpoint when it has a port;
4. run the role's ``main`` as a named task under one `asyncio.TaskGroup`, with
   SIGTERM and SIGINT setting one stop event: the role stops taking work and returns.
   A component task that dies ends the role loudly (exit 1) instead of leaving it
   half-alive.

SIGUSR1 writes every thread's Python stack to stderr (`faulthandler`), then, once the event
loop turns, every asyncio task's stack, and the process goes on: how to see where a process
that stopped making progress is waiting (a thread's stack shows only the loop's `select` when
a coroutine awaits forever), with no debugger in the container (``docker kill -s USR1``,
``kubectl exec … kill -USR1 1``).

Exit codes: 0 done, 1 runtime failure, 2 bad configuration (argparse's own errors too).
"""

from __future__ import annotations

import argparse
import asyncio
import faulthandler
import json
import logging
import os
import signal
import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, TypeVar

from launch.logs import setup_logging
from launch.settings import RoleConfig, add_flags, flag_values, helpful, masked

C = TypeVar("C", bound=RoleConfig)

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


@dataclass(frozen=True)
class RoleContext(Generic[C]):
    """What a role's main coroutine is handed."""

    config: C
    args: argparse.Namespace  # the parsed command line (the role's own arguments included)
    stop: asyncio.Event  # set by SIGTERM/SIGINT: stop taking work, finish, return
    tasks: asyncio.TaskGroup  # the role's TaskGroup: start components here, named
    prepared: Any = None  # what the role's `prepare` returned (a worker's tokenizer)


def _metrics_port(config: RoleConfig) -> int:
    return int(getattr(config, "metrics_port", 0) or 0)


def _no_loop_factory(config: RoleConfig) -> Callable[[], asyncio.AbstractEventLoop] | None:
    return None


@dataclass(frozen=True)
class Role(Generic[C]):
    """How one role process starts."""

    name: str  # program name (`python -m <name>`) and logger name
    config: type[C]
    main: Callable[[RoleContext[C]], Awaitable[int | None]]  # returns the exit status (None: 0)
    description: str  # first line of --help
    epilog: str = ""  # the end of --help (commands handled before parsing, e.g. `evaluate`)
    add_arguments: Callable[[argparse.ArgumentParser], None] | None = None  # e.g. subcommands
    # Synchronous set-up after the config is logged, before stop signals are handled (a
    # SIGTERM ends the process at once): rlimits, torch threads, heavy imports. Its result
    # reaches `main` as `RoleContext.prepared`.
    prepare: Callable[[C], Any] | None = None
    loop_factory: Callable[[C], Callable[[], asyncio.AbstractEventLoop] | None] = _no_loop_factory
    metrics_port: Callable[[C], int] = _metrics_port  # 0: no /metrics endpoint
    failures: tuple[type[Exception], ...] = field(default=())  # reported in one line, exit 1


def build_parser(role: Role[Any]) -> argparse.ArgumentParser:
    """The role's argument parser: `--config`, the config's flags, the role's own arguments."""
    parser = argparse.ArgumentParser(
        prog=f"python -m {role.name}",
        description=role.description,
        epilog=role.epilog or None,
        argument_default=argparse.SUPPRESS,
    )
    parser.add_argument("--config", type=Path, help="TOML file with config values")
    add_flags(parser, role.config)
    if role.add_arguments is not None:
        role.add_arguments(parser)
    return helpful(parser)


def parse(role: Role[C], argv: list[str]) -> tuple[C, argparse.Namespace]:
    """Parse `argv` and resolve the config; raises the config's error type."""
    args = build_parser(role).parse_args(argv)
    toml = getattr(args, "config", None)
    return role.config.load(flag_values(args, role.config), toml), args


def start(role: Role[C], argv: list[str] | None = None) -> int:
    """Run `role` as this process; returns its exit status."""
    try:
        config, args = parse(role, sys.argv[1:] if argv is None else argv)
    except role.config.error as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    setup_logging(config.log_level)  # type: ignore[attr-defined]
    _dump_stacks_on_sigusr1()
    log = logging.getLogger(role.name)
    log.info("%s", json.dumps({"event": "config", **masked(config)}))
    try:
        prepared = role.prepare(config) if role.prepare is not None else None
        port = role.metrics_port(config)
        if port:
            from prometheus_client import start_http_server

            start_http_server(port)
        with asyncio.Runner(loop_factory=role.loop_factory(config)) as runner:
            return runner.run(_supervise(role, config, args, prepared)) or 0
    except role.failures as exc:
        log.error("error: %s", exc)
        return 1
    except KeyboardInterrupt:
        return 130
    except Exception:
        log.exception("%s failed", role.name)
        return 1


async def _supervise(
    role: Role[C], config: C, args: argparse.Namespace, prepared: Any
) -> int | None:
    stop = asyncio.Event()
    remove = on_stop_signals(lambda _signal: stop.set())
    undump = _dump_tasks_on_sigusr1()
    try:
        async with asyncio.TaskGroup() as tasks:
            body = tasks.create_task(
                role.main(RoleContext(config, args, stop, tasks, prepared)),
                name=f"{role.name}-main",
            )
        return body.result()
    except BaseExceptionGroup as group:
        # One failed component: raise its own error, so the role reports it by name.
        if len(group.exceptions) == 1:
            raise group.exceptions[0] from None
        raise
    finally:
        undump()
        remove()


def _dump_stacks_on_sigusr1(chain: bool = False) -> None:
    # The process's own stderr (fd 2), not sys.stderr: a role started in-process (the CLI
    # tests) may have it replaced by an object without a file descriptor.
    if sys.__stderr__ is not None:
        faulthandler.register(signal.SIGUSR1, file=sys.__stderr__, all_threads=True, chain=chain)


def _dump_tasks_on_sigusr1() -> Callable[[], None]:
    """The loop's SIGUSR1 handler prints every task's stack; faulthandler is registered again
    over it, chaining to it, so the threads' stacks still come first (and come at all when
    the loop itself is stuck). Returns the undo: the threads' dump alone, as before the loop
    (closing the loop would otherwise reset SIGUSR1 to its default, which kills)."""
    if sys.__stderr__ is None:
        return lambda: None
    loop = asyncio.get_running_loop()
    # unregistering restores the handler faulthandler replaced; registering again over the
    # loop's installs faulthandler's own (a second register alone would keep the loop's)
    faulthandler.unregister(signal.SIGUSR1)
    loop.add_signal_handler(signal.SIGUSR1, _print_tasks)
    _dump_stacks_on_sigusr1(chain=True)

    def undo() -> None:
        faulthandler.unregister(signal.SIGUSR1)
        loop.remove_signal_handler(signal.SIGUSR1)
        _dump_stacks_on_sigusr1()

    return undo


def _print_tasks() -> None:
    out = sys.__stderr__
    tasks = sorted(asyncio.all_tasks(), key=lambda t: t.get_name())
    print(f"asyncio: {len(tasks)} tasks", file=out)
    for task in tasks:
        task.print_stack(limit=12, file=out)
    out.flush()


def on_stop_signals(callback: Callable[[signal.Signals], Any]) -> Callable[[], None]:
    """Call `callback(signal)` on SIGTERM and SIGINT in the running loop; returns the undo."""
    loop = asyncio.get_running_loop()
    for sig in STOP_SIGNALS:
        loop.add_signal_handler(sig, callback, sig)

    def remove() -> None:
        for sig in STOP_SIGNALS:
            loop.remove_signal_handler(sig)

    return remove


def process_rank() -> int:
    """This process's rank under torchrun (0 when not distributed)."""
    return int(os.environ.get("RANK", "0"))
