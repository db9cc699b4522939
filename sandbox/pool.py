"""The sandbox pool: warm sandboxes, session slots, health checks, recycling, reaping.

Invariants:
- a sandbox serves at most `sessions_per_sandbox` sessions at once; 1 is strict isolation;
- a sandbox that saw a violation, or that served `recycle_after` sessions, takes no new
  session and is removed once its last session closes;
- `warm` sandboxes with no session (or still starting) are kept ahead of demand by the
  maintainer task, which also pings idle sandboxes and replaces the ones that fail;
- at start-up, sandboxes and socket directories left by a dead pool process are reaped;
  at close every sandbox of this pool is removed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import shutil
import weakref
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from sandbox import metrics
from sandbox.backends import (
    Backend,
    BwrapBackend,
    Handle,
    UnsafeBackend,
    owner_token,
    reap_socket_dirs,
)
from sandbox.bridge import Bridge, serve_bridge
from sandbox.client import AgentConnection, check
from sandbox.config import SandboxConfig
from sandbox.errors import (
    AcquireTimeout,
    AgentProtocolError,
    PoolClosed,
    SandboxError,
    SandboxUnavailable,
)
from sandbox.session import Session

log = logging.getLogger(__name__)

CONTROL_TIMEOUT_S = 10.0
UID_RANGE = 1_000_000
_POOLS: weakref.WeakSet[SandboxPool] = weakref.WeakSet()


@dataclass(eq=False)
class Sandbox:
    """One running sandbox as the pool tracks it."""

    handle: Handle
    control: AgentConnection | None = None
    state: str = "starting"  # starting, idle, busy, recycling
    sessions: set[str] = field(default_factory=set)
    reserved: int = 0  # slots promised to acquirers still opening their session
    served: int = 0
    draining: bool = False  # no new sessions: violation, use count or failed check

    @property
    def load(self) -> int:
        return len(self.sessions) + self.reserved


class SandboxPool:
    """Async pool of sandboxes; `async with pool.session() as s: await s.run_python(...)`."""

    def __init__(self, config: SandboxConfig) -> None:
        self.config = config
        self.owner = owner_token()
        self.pool_id = secrets.token_hex(4)
        self.dir = config.socket_dir / self.pool_id
        self.backend: Backend = self._make_backend()
        self._sandboxes: list[Sandbox] = []
        self._changed = asyncio.Condition()
        self._wake = asyncio.Event()
        self._maintainer: asyncio.Task[None] | None = None
        self._counter = 0
        # pools on one host (worker processes, test runs) draw uids from one range; a
        # random start keeps their RLIMIT_NPROC counts and signals apart
        self._uid_offset = secrets.randbelow(UID_RANGE)
        # bwrap cannot map several uids into its user namespace unprivileged: one jail
        # (and one uid) per session there; elsewhere one uid per session slot
        self.capacity = config.capacity
        self._warned: set[str] = set()
        self._started = False
        self._closed = False
        _POOLS.add(self)

    @property
    def closed(self) -> bool:
        return self._closed

    def _make_backend(self) -> Backend:
        if self.config.backend == "docker":
            from sandbox.docker_backend import DockerBackend

            return DockerBackend(self.config, self.owner)
        if self.config.backend == "bwrap":
            return BwrapBackend(self.config)
        return UnsafeBackend(self.config)

    async def __aenter__(self) -> SandboxPool:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def start(self) -> None:
        """Reap leftovers of dead pools, check the backend, warm up, start the maintainer."""
        if self._closed:
            raise PoolClosed("pool is closed")
        reaped = await asyncio.to_thread(reap_socket_dirs, self.config.socket_dir)
        if reaped:
            log.warning("removed %d socket directories of dead sandbox pools", reaped)
        await asyncio.to_thread(self._make_dir)
        await self.backend.prepare()
        self._started = True
        log.info("sandbox pool %s started: %s", self.pool_id, self.config.model_dump_json())
        if self.config.warm:
            async with asyncio.TaskGroup() as tg:
                for _ in range(self.config.warm):
                    tg.create_task(self._launch_warm(), name="sandbox-warm")
        self._maintainer = asyncio.create_task(self._maintain(), name="sandbox-pool-maintainer")

    def _make_dir(self) -> None:
        self.dir.mkdir(parents=True, mode=0o700)
        (self.dir / "owner").write_text(self.owner)

    async def close(self) -> None:
        """Remove every sandbox of this pool; safe to call twice."""
        if self._closed:
            return
        self._closed = True
        if self._maintainer is not None:
            self._maintainer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._maintainer
        sandboxes, self._sandboxes = self._sandboxes, []
        await asyncio.gather(*(self._destroy(sb, recycled=False) for sb in sandboxes))
        await self.backend.close()
        await asyncio.to_thread(shutil.rmtree, self.dir, True)
        async with self._changed:
            self._changed.notify_all()
        self._publish()

    @contextlib.asynccontextmanager
    async def session(self, bridge: Bridge | None = None) -> AsyncIterator[Session]:
        """One environment session: its own process and work dir, kept across calls.

        With ``bridge``, the session's calls can reach a socket of the host: the pool calls
        ``bridge(path)`` before the session opens, which must listen on a Unix socket at
        ``path`` until it exits (after the session closed). Every process a `run` call starts
        holds it as descriptor 5 (``sandbox.agent.call.BRIDGE_FD``; `Session.run_bridged`
        turns it into a loopback port); no other session can reach it.
        """
        session = await self.acquire(bridge)
        try:
            yield session
        finally:
            await asyncio.shield(self.release(session))

    async def acquire(self, bridge: Bridge | None = None) -> Session:
        """Open a session (prefer `session()`); raises AcquireTimeout, SandboxUnavailable."""
        if not self._started or self._closed:
            raise PoolClosed("pool is not started" if not self._closed else "pool is closed")
        loop = asyncio.get_running_loop()
        began = loop.time()
        sandbox = await self._reserve(began + self.config.acquire_timeout_s)
        sid = secrets.token_hex(8)
        stack = contextlib.AsyncExitStack()
        try:
            name = await serve_bridge(stack, sandbox.handle.socket_dir, sid, bridge)
            session = await self._open_session(sandbox, sid, name)
        except BaseException:
            await stack.aclose()
            sandbox.reserved -= 1
            sandbox.draining = True
            await self._settle(sandbox)
            raise
        session.bridge, session.bridge_stack = name, stack
        sandbox.reserved -= 1
        sandbox.sessions.add(sid)
        metrics.SESSIONS_ACTIVE.inc()
        metrics.ACQUIRE_SECONDS.observe(loop.time() - began)
        self._set_state(sandbox)
        return session

    async def _open_session(self, sandbox: Sandbox, sid: str, bridge: str | None) -> Session:
        assert sandbox.control is not None
        request: dict[str, object] = {"op": "open", "session": sid}
        if bridge is not None:
            request["bridge"] = bridge
        try:
            request["limits"] = self.config.limits.ceiling(self.config.baseline_processes)
            reply = check(await sandbox.control.request(request, CONTROL_TIMEOUT_S), "open session")
            conn = await AgentConnection.open(
                sandbox.handle.socket_dir / reply["socket"], CONTROL_TIMEOUT_S
            )
        except (OSError, TimeoutError) as exc:
            raise SandboxUnavailable(f"sandbox {sandbox.handle.name} failed: {exc!r}") from exc
        return Session(self, sandbox, sid, conn)

    async def reopen(self, session: Session) -> AgentConnection:
        """A fresh session process on the same work dir, after the old one was killed."""
        sandbox: Sandbox = session.sandbox
        if sandbox.control is None or sandbox.control.closed:
            raise SandboxUnavailable("the sandbox is gone")
        fresh = await self._open_session(sandbox, session.id, session.bridge)
        return fresh.connection

    async def release(self, session: Session) -> None:
        """Close a session: kill its processes, delete its work dir, free the slot."""
        sandbox: Sandbox = session.sandbox
        session.closed = True
        await session.connection.close()
        try:
            await self._close_session(sandbox, session)
        finally:
            await session.bridge_stack.aclose()

    async def _close_session(self, sandbox: Sandbox, session: Session) -> None:
        if session.id not in sandbox.sessions:
            return
        sandbox.sessions.discard(session.id)
        sandbox.served += 1
        metrics.SESSIONS_ACTIVE.dec()
        if sandbox.served >= self.config.recycle_after:
            sandbox.draining = True
        # closed even in a sandbox marked for recycling, unless the sandbox goes now: its
        # processes and memory must not wait for the sandbox's last neighbour to leave
        going = sandbox.draining and sandbox.load == 0
        if sandbox.control is not None and not sandbox.control.closed and not going:
            try:
                check(
                    await sandbox.control.request(
                        {"op": "close", "session": session.id}, CONTROL_TIMEOUT_S
                    ),
                    "close session",
                )
            except (OSError, TimeoutError, SandboxError) as exc:
                log.warning(
                    "closing session on %s failed (%r); recycling", sandbox.handle.name, exc
                )
                sandbox.draining = True
        await self._settle(sandbox)

    def taint(self, session: Session, why: str) -> None:
        """Mark a session's sandbox for recycling (a violation, a lost session)."""
        sandbox: Sandbox = session.sandbox
        if not sandbox.draining:
            log.info("sandbox %s will be recycled: %s", sandbox.handle.name, why)
            sandbox.draining = True
            self._wake.set()

    async def _settle(self, sandbox: Sandbox) -> None:
        """After a session ends: recycle a drained, empty sandbox; wake waiters."""
        if sandbox.draining and sandbox.load == 0 and sandbox in self._sandboxes:
            self._sandboxes.remove(sandbox)
            await self._destroy(sandbox, recycled=True)
        else:
            self._set_state(sandbox)
        self._wake.set()
        async with self._changed:
            self._changed.notify_all()

    async def _reserve(self, deadline: float) -> Sandbox:
        loop = asyncio.get_running_loop()
        async with self._changed:
            while True:
                if self._closed:
                    raise PoolClosed("pool is closed")
                sandbox = self._pick()
                if sandbox is not None:
                    sandbox.reserved += 1
                    return sandbox
                sandbox = self._pick(starting=True)
                if sandbox is not None:
                    # a sandbox on its way has room: a burst of acquires shares it
                    # instead of starting one container each
                    sandbox.reserved += 1
                    while sandbox.state == "starting" and sandbox in self._sandboxes:
                        await self._changed.wait()
                    if sandbox in self._sandboxes and sandbox.state in ("idle", "busy"):
                        return sandbox
                    sandbox.reserved -= 1
                    continue
                if len(self._sandboxes) < self.config.max_sandboxes:
                    sandbox = self._new_sandbox()
                    sandbox.reserved += 1
                    break
                remaining = deadline - loop.time()
                if remaining <= 0:
                    raise AcquireTimeout(
                        f"no sandbox slot free within {self.config.acquire_timeout_s}s "
                        f"({len(self._sandboxes)} sandboxes, all full or draining)"
                    )
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(remaining):
                        await self._changed.wait()
        await self._launch(sandbox)
        return sandbox

    def _pick(self, starting: bool = False) -> Sandbox | None:
        """The fullest ready (or starting) sandbox with room: packing keeps others idle."""
        cap = self.capacity
        states = ("starting",) if starting else ("idle", "busy")
        ready = [
            sb for sb in self._sandboxes if sb.state in states and not sb.draining and sb.load < cap
        ]
        return max(ready, key=lambda sb: sb.load, default=None)

    def _new_sandbox(self) -> Sandbox:
        self._counter += 1
        name = f"rf-{self.pool_id}-{self._counter}"
        # a block of uids per sandbox: its own, then one per session slot
        stride = self.config.sessions_per_sandbox + 1
        block = (self._uid_offset + self._counter) % (UID_RANGE // stride)
        uid = self.config.uid_base + block * stride
        sandbox = Sandbox(Handle(name, self.dir / str(self._counter), uid))
        self._sandboxes.append(sandbox)
        self._publish()
        return sandbox

    async def _launch_warm(self) -> None:
        async with self._changed:
            if len(self._sandboxes) >= self.config.max_sandboxes:
                return
            sandbox = self._new_sandbox()
        await self._launch(sandbox)
        async with self._changed:
            self._changed.notify_all()

    async def _launch(self, sandbox: Sandbox) -> None:
        """Start the sandbox and connect to its agent; on failure it is removed."""
        try:
            await asyncio.to_thread(sandbox.handle.socket_dir.mkdir, 0o755)
            starting = asyncio.ensure_future(
                self.backend.start(
                    sandbox.handle.name, sandbox.handle.uid, sandbox.handle.socket_dir
                )
            )
            try:
                sandbox.handle = await asyncio.shield(starting)
            except asyncio.CancelledError:
                # the engine call runs on in its thread: wait for it, so that what it
                # creates is removed below instead of leaking until the next start-up
                with contextlib.suppress(Exception):
                    sandbox.handle = await starting
                raise
            sandbox.control = await self._connect(sandbox.handle)
        except BaseException as exc:
            if sandbox in self._sandboxes:
                self._sandboxes.remove(sandbox)
            await self._destroy(sandbox, recycled=False)
            async with self._changed:
                self._changed.notify_all()
            if isinstance(exc, (OSError, TimeoutError, AgentProtocolError)):
                raise SandboxUnavailable(
                    f"sandbox {sandbox.handle.name} did not start: {exc!r}"
                ) from exc
            raise
        self._set_state(sandbox)
        async with self._changed:
            self._changed.notify_all()

    async def _connect(self, handle: Handle) -> AgentConnection:
        """Wait for the agent socket, then ping it.

        Nothing signals that a process in a container bound its socket, so this polls
        with a short sleep, bounded by start_timeout_s.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.start_timeout_s
        path = handle.socket_dir / "agent.sock"
        delay = 0.002
        while True:
            try:
                conn = await AgentConnection.open(path, CONTROL_TIMEOUT_S)
                reply = check(await conn.request({"op": "ping"}, CONTROL_TIMEOUT_S), "ping")
            except OSError:
                if loop.time() > deadline or not await self.backend.alive(handle):
                    raise TimeoutError(f"agent of {handle.name} never answered") from None
                await asyncio.sleep(delay)
                delay = min(delay * 2, 0.05)
                continue
            try:
                self._check_isolation(handle, reply.get("missing") or {})
            except SandboxUnavailable:
                await conn.close()
                raise
            return conn

    def _check_isolation(self, handle: Handle, missing: dict[str, str]) -> None:
        """Refuse a sandbox whose sessions cannot have namespaces of their own; say once,
        loudly, which resource bounds it cannot make (docs/sandbox.md, threat model)."""
        missing = {**missing, **handle.missing}
        if "namespaces" in missing and self.config.backend != "unsafe-no-isolation":
            raise SandboxUnavailable(
                f"sandbox {handle.name} cannot give sessions their own namespaces "
                f"({missing['namespaces']}); see docs/sandbox.md, 'Requirements'"
            )
        for bound, why in missing.items():
            if bound not in self._warned:
                self._warned.add(bound)
                log.warning(
                    "SANDBOX BOUND MISSING: per-session %s are not made in this sandbox (%s); "
                    "a session can take a neighbour's share (docs/sandbox.md, threat model)",
                    bound,
                    why,
                )

    async def _destroy(self, sandbox: Sandbox, recycled: bool) -> None:
        sandbox.state = "recycling"
        self._publish()
        if sandbox.control is not None:
            await sandbox.control.close()
        await self.backend.stop(sandbox.handle)
        if recycled:
            metrics.RECYCLED.inc()
        self._publish()

    def _set_state(self, sandbox: Sandbox) -> None:
        if sandbox.control is not None and sandbox.state != "recycling":
            sandbox.state = "busy" if sandbox.sessions else "idle"
        self._publish()

    def _publish(self) -> None:
        """Set the state gauge from every pool of this process (a worker may hold several)."""
        counts = dict.fromkeys(metrics.STATES, 0)
        for pool in _POOLS:
            for sb in pool._sandboxes:
                counts[sb.state] += 1
        for state, n in counts.items():
            metrics.CONTAINERS.labels(state=state).set(n)

    async def _maintain(self) -> None:
        """Keep `warm` spare sandboxes, ping idle ones, recycle drained empty ones."""
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.config.health_interval_s):
                    await self._wake.wait()
            self._wake.clear()
            await self._health_check()
            spare = sum(
                1
                for sb in self._sandboxes
                if not sb.draining and (sb.state == "starting" or sb.load == 0)
            )
            for _ in range(self.config.warm - spare):
                try:
                    await self._launch_warm()
                except SandboxError as exc:
                    log.error("could not warm a sandbox: %s", exc)
                    break

    async def _health_check(self) -> None:
        for sandbox in list(self._sandboxes):
            if sandbox.state != "idle" or sandbox.load:
                continue
            healthy = not sandbox.draining and sandbox.control is not None
            if healthy:
                try:
                    check(await sandbox.control.request({"op": "ping"}, 2.0), "ping")
                except (OSError, TimeoutError, SandboxError) as exc:
                    log.warning("sandbox %s failed its health check: %r", sandbox.handle.name, exc)
                    healthy = False
            if not healthy and sandbox.load == 0 and sandbox in self._sandboxes:
                self._sandboxes.remove(sandbox)
                await self._destroy(sandbox, recycled=True)

    def stats(self) -> dict[str, int]:
        """Sandboxes by state and open sessions, for logs and benchmarks."""
        out = dict.fromkeys(metrics.STATES, 0)
        for sb in self._sandboxes:
            out[sb.state] += 1
        out["sessions"] = sum(len(sb.sessions) for sb in self._sandboxes)
        return out
