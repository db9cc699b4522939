"""The process-wide resources a worker sets up besides Redis and inference.

- `import_env_modules`: imports the modules named in `--env-modules`, which register
  extra environments in the `envs` registry (a plugin mechanism: the worker needs no
  code change to run a new environment);
- `open_sandbox`: the sandbox pool handed to environments that take one, or no pool;
- `tune_gc`: garbage-collector settings for processes holding thousands of episodes;
- `loop_factory`: the event loop the worker runs on;
- `raise_open_files_limit`: room for a connection (and sandbox socket) per episode.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import resource
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from workers.errors import ConfigError


def import_env_modules(modules: Sequence[str]) -> None:
    """Import each module (they call `envs.register`); a missing one is a config error."""
    for name in modules:
        try:
            importlib.import_module(name)
        except ImportError as exc:
            raise ConfigError(f"cannot import env module {name!r}: {exc}") from exc


@contextlib.asynccontextmanager
async def open_sandbox(backend: str) -> AsyncIterator[Any]:
    """Yield a started `SandboxPool` for `backend`, or None for backend "none"."""
    if backend == "none":
        yield None
        return
    from sandbox import SandboxConfig, SandboxPool

    async with SandboxPool(SandboxConfig(backend=backend)) as pool:
        yield pool


def tune_gc() -> None:
    """Move start-up objects out of the collector's view and collect less often.

    With thousands of episodes in flight, CPython's default thresholds run full
    collections over millions of live objects many times a second: in the worker
    benchmark that took >60% of the process's CPU and stalled the event loop for
    seconds. Episodes create few reference cycles, so rarer collections cost little memory.
    """
    gc.collect()
    gc.freeze()
    gc.set_threshold(200_000, 50, 1000)


def loop_factory(name: str) -> Callable[[], Any] | None:
    """The event-loop factory for `asyncio.Runner` ("asyncio": the default loop).

    uvloop (libuv, in C) runs callbacks, timers and socket I/O for about a third less
    CPU per env step than asyncio's pure-Python loop (`python -m bench workers`).
    """
    if name == "asyncio":
        return None
    if name == "uvloop":
        import uvloop

        return uvloop.new_event_loop
    raise ConfigError(f"unknown event loop {name!r}")


def raise_open_files_limit() -> int:
    """Raise the soft open-files limit to the hard one (as vLLM's server does); returns it.

    Thousands of episodes hold thousands of inference connections, and the common soft
    default of 1,024 descriptors would fail them with EMFILE.
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass  # a container may forbid it: keep the soft limit
    return soft
