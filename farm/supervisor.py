"""A process supervisor for the one-machine farm: start in order, restart, stop cleanly.

`Supervisor` runs each child described by a `ProcessSpec` as an asyncio subprocess
under one `asyncio.TaskGroup`. Children start in the order given; the next starts
once the previous one's readiness probe passes (consecutive children of one
`start_group`, such as vLLM servers, start together and are waited for together),
except after a child whose spec does not `gate_start`: the ones after it start at
once, while it loads (the CPU policy server, which the workers wait for themselves).
"All processes started" still means every child passed its probe within its
`ready_timeout_s`. A child that exits while the farm
runs is restarted with exponential backoff, until it crashes more than its
`RestartPolicy` allows within the window, which stops the whole farm loudly
(`ChildFailed`). A child marked `finishes_stack` that exits 0 (the learner after
`--max-steps`) ends the farm normally; one that exits with a status its spec marks
fatal (the learner's bad dataset, a run that cannot progress) stops the farm at once
with that child's last error line (`ChildFailed`). Every output line reaches the sink
with the child's name.

Invariant: when `run()` returns, by any path (stop request, SIGINT/SIGTERM, a
failure, cancellation), every child and everything it spawned is gone. Each child
leads its own process group; stopping sends SIGTERM to the group in reverse start
order (the children of one `start_group` together), waits `stop_timeout_s`, then
SIGKILLs the group. On Linux each child also
gets PR_SET_PDEATHSIG, so a SIGKILLed supervisor does not leave orphans behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import os
import signal
import sys
from collections import deque
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from farm.errors import ChildFailed, FarmError, StartupError
from farm.metrics import CHILD_UP, RESTARTS
from launch.runner import on_stop_signals

log = logging.getLogger(__name__)

Probe = Callable[[], Awaitable[bool]]
LineSink = Callable[[str, str], None]
Service = Callable[[asyncio.Event], Awaitable[None]]
ChildWatch = Callable[[str, bool], None]  # (child name, running now)

_PR_SET_PDEATHSIG = 1


@dataclass(frozen=True)
class RestartPolicy:
    """How a crashed child is brought back."""

    initial_backoff_s: float = 0.5  # first delay; doubles per consecutive crash
    max_backoff_s: float = 30.0  # cap on the delay
    max_restarts: int = 5  # crashes tolerated within `window_s` before the farm gives up
    window_s: float = 300.0  # a child that ran this long starts its backoff afresh

    def backoff(self, attempt: int) -> float:
        return min(self.max_backoff_s, self.initial_backoff_s * 2**attempt)


@dataclass(frozen=True)
class ProcessSpec:
    """One child process of the farm."""

    name: str  # log prefix and metrics label
    argv: tuple[str, ...]  # program and arguments (no shell)
    env: Mapping[str, str] = field(default_factory=dict)  # added to the supervisor's environment
    cwd: Path | None = None
    ready: Probe | None = None  # None: ready once spawned; else polled until True
    ready_timeout_s: float = 120.0  # how long the first start may take to become ready
    stop_timeout_s: float = 15.0  # SIGTERM grace before SIGKILL
    finishes_stack: bool = False  # exit status 0 ends the farm instead of a restart
    # Statuses that mean a restart cannot help (bad input, a run that cannot progress): the
    # farm stops at once with the child's last error line instead of restarting it.
    fatal_exit_codes: frozenset[int] = frozenset()
    metrics_url: str | None = None  # its /metrics endpoint, for the console view
    # Consecutive children of one group start together, and the next child starts once all
    # of them are ready (servers that each take minutes to load a model); they also stop
    # together (workers, each finishing its groups within its own grace).
    start_group: str | None = None
    # False: the children after it start without waiting for its readiness (they tolerate
    # it not being ready yet); its probe still bounds start-up by `ready_timeout_s`.
    gate_start: bool = True


def _set_parent_death_signal() -> None:
    """Runs in the child between fork and exec: die with the supervisor."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


class _Child:
    """One supervised child: its current process, readiness and crash history."""

    def __init__(
        self,
        spec: ProcessSpec,
        policy: RestartPolicy,
        sink: LineSink,
        stopping: asyncio.Event,
        on_finished: Callable[[str], None],
        *,
        on_running: ChildWatch | None = None,
    ) -> None:
        self.spec = spec
        self.policy = policy
        self.sink = sink
        self.stopping = stopping
        self.on_finished = on_finished
        self.on_running = on_running  # told (name, True) on each start, (name, False) on exit
        self.proc: asyncio.subprocess.Process | None = None
        self.ready = asyncio.Event()
        self.crashes: deque[float] = deque()
        self.restarts = 0
        self.last_exit: int | None = None
        self.last_error = ""  # the child's latest error line, for a fatal exit's message

    async def supervise(self) -> None:
        loop = asyncio.get_running_loop()
        attempt = 0
        while not self.stopping.is_set():
            started = loop.time()
            rc = await self._run_once()
            self.last_exit = rc
            if self.stopping.is_set():
                return
            if rc == 0 and self.spec.finishes_stack:
                self.sink("farm", f"{self.spec.name} finished")
                self.on_finished(f"{self.spec.name} finished")
                return
            if rc in self.spec.fatal_exit_codes:
                raise ChildFailed(
                    f"{self.spec.name} exited with status {rc} (not restarted): "
                    + (self.last_error or "it printed no error line")
                )
            now = loop.time()
            if now - started >= self.policy.window_s:
                attempt = 0
            self.crashes.append(now)
            while self.crashes and now - self.crashes[0] > self.policy.window_s:
                self.crashes.popleft()
            if len(self.crashes) > self.policy.max_restarts:
                raise ChildFailed(
                    f"{self.spec.name} exited {len(self.crashes)} times within "
                    f"{self.policy.window_s:.0f}s (last status {rc}); giving up"
                )
            delay = self.policy.backoff(attempt)
            attempt += 1
            self.sink("farm", f"{self.spec.name} exited with status {rc}; restart in {delay:.1f}s")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.stopping.wait(), delay)
            if not self.stopping.is_set():
                self.restarts += 1
                RESTARTS.labels(process=self.spec.name).inc()

    async def _run_once(self) -> int:
        spec = self.spec
        try:
            proc = await asyncio.create_subprocess_exec(
                *spec.argv,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.STDOUT,
                env={**os.environ, **spec.env},
                cwd=spec.cwd,
                start_new_session=True,
                preexec_fn=_set_parent_death_signal if sys.platform == "linux" else None,
            )
        except OSError as exc:
            raise StartupError(f"cannot start {spec.name} ({spec.argv[0]}): {exc}") from exc
        self.proc = proc
        self.sink("farm", f"{spec.name} started (pid {proc.pid})")
        CHILD_UP.labels(process=spec.name).set(1)
        if self.on_running is not None:
            self.on_running(spec.name, True)
        try:
            async with asyncio.TaskGroup() as tg:
                assert proc.stdout is not None
                tg.create_task(self._pump(proc.stdout), name=f"{spec.name}-output")
                probe = None
                if not self.ready.is_set():
                    probe = tg.create_task(self._await_ready(proc), name=f"{spec.name}-ready")
                rc = await proc.wait()
                if probe is not None:
                    probe.cancel()
                # Whatever the child left in its process group dies with it.
                self.signal_group(signal.SIGKILL)
        finally:
            CHILD_UP.labels(process=spec.name).set(0)
            if self.on_running is not None:
                self.on_running(spec.name, False)
        return rc

    async def _pump(self, stream: asyncio.StreamReader) -> None:
        while True:
            try:
                line = await stream.readline()
            except ValueError:  # a line longer than the reader's limit: drop the rest of it
                line = b"<line too long, truncated>\n"
            if not line:
                return
            text = line.decode("utf-8", "replace").rstrip("\n")
            if " ERROR " in text or text.startswith("error:"):
                self.last_error = text.split(" ERROR ", 1)[-1]
            self.sink(self.spec.name, text)

    async def _await_ready(self, proc: asyncio.subprocess.Process) -> None:
        if self.spec.ready is None:
            self.ready.set()
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.spec.ready_timeout_s
        while loop.time() < deadline:
            if await self.spec.ready():
                self.ready.set()
                return
            await asyncio.sleep(0.2)
        if proc.returncode is None:
            raise StartupError(f"{self.spec.name} not ready after {self.spec.ready_timeout_s:.0f}s")

    def signal_group(self, sig: signal.Signals) -> None:
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, sig)

    async def terminate(self) -> None:
        proc = self.proc
        if proc is None:
            return
        if proc.returncode is None:
            self.signal_group(signal.SIGTERM)
            try:
                await asyncio.wait_for(proc.wait(), self.spec.stop_timeout_s)
            except TimeoutError:
                self.sink("farm", f"{self.spec.name} ignored SIGTERM; killing it")
                self.signal_group(signal.SIGKILL)
                await proc.wait()
        self.signal_group(signal.SIGKILL)


class Supervisor:
    """Starts `specs` in order, keeps them running, stops them in reverse order."""

    def __init__(
        self,
        specs: Sequence[ProcessSpec],
        sink: LineSink,
        policy: RestartPolicy | None = None,
        on_running: ChildWatch | None = None,
    ) -> None:
        """`on_running(name, running)` hears of every start and exit of a child (farm.monitor)."""
        names = [s.name for s in specs]
        if len(set(names)) != len(names):
            raise ValueError(f"process names must be unique: {names}")
        self._stopping = asyncio.Event()
        self.stop_reason = ""
        self.sink = sink
        self.children = [
            _Child(
                s,
                policy or RestartPolicy(),
                sink,
                self._stopping,
                self.request_stop,
                on_running=on_running,
            )
            for s in specs
        ]
        self.started = asyncio.Event()

    def request_stop(self, reason: str) -> None:
        if not self._stopping.is_set():
            self.stop_reason = reason
            self.sink("farm", f"stopping: {reason}")
            self._stopping.set()

    def child(self, name: str) -> _Child:
        return next(c for c in self.children if c.spec.name == name)

    def install_signal_handlers(self) -> None:
        on_stop_signals(lambda sig: self.request_stop(f"received {sig.name}"))

    async def run(self, *services: Service) -> None:
        """Run until a stop request; raises ChildFailed/StartupError after stopping all."""
        try:
            async with asyncio.TaskGroup() as tg:
                if await self._start_all(tg):
                    self.started.set()
                    self.sink("farm", "all processes started")
                    for service in services:
                        name = getattr(service, "__name__", "service")
                        tg.create_task(service(self._stopping), name=name)
                await self._stopping.wait()
                await self._shutdown()
        except BaseExceptionGroup as group:
            # Surface the farm's own error (ChildFailed, StartupError) rather than the group.
            first = _first_farm_error(group)
            if first is None:
                raise
            raise first from group
        finally:
            self._stopping.set()
            await asyncio.shield(self._shutdown())

    async def _start_all(self, tg: asyncio.TaskGroup) -> bool:
        """Start every child in order; True once all are ready, False on a stop request."""
        ungated: list[_Child] = []  # started, not yet waited for
        for batch in self._start_batches():
            for child in batch:
                tg.create_task(child.supervise(), name=f"supervise-{child.spec.name}")
            for child in batch:
                if child.spec.gate_start:
                    await self._until_ready(child)
                else:
                    ungated.append(child)
            if self._stopping.is_set():
                return False
        for child in ungated:
            await self._until_ready(child)
        return not self._stopping.is_set()

    def _start_batches(self) -> list[list[_Child]]:
        """The children in start order, consecutive ones of one `start_group` together."""
        batches: list[list[_Child]] = []
        for child in self.children:
            group = child.spec.start_group
            if batches and group is not None and batches[-1][0].spec.start_group == group:
                batches[-1].append(child)
            else:
                batches.append([child])
        return batches

    async def _until_ready(self, child: _Child) -> None:
        ready = asyncio.create_task(child.ready.wait(), name=f"{child.spec.name}-ready-wait")
        stop = asyncio.create_task(self._stopping.wait(), name="stop-wait")
        try:
            await asyncio.wait({ready, stop}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            ready.cancel()
            stop.cancel()

    async def _shutdown(self) -> None:
        # reverse start order; the children of one start group stop together
        for batch in reversed(self._start_batches()):
            await asyncio.gather(*(child.terminate() for child in batch))


def _first_farm_error(group: BaseExceptionGroup) -> FarmError | None:
    for exc in group.exceptions:
        if isinstance(exc, FarmError):
            return exc
        if isinstance(exc, BaseExceptionGroup) and (inner := _first_farm_error(exc)):
            return inner
    return None
