"""One environment session: `run` / `run_python` calls into a long-lived session process.

The session's work directory persists across calls, so environment state can live
there. Each call is one request on the session's socket. Hostile code comes back as
a `RunResult` with a violation (and the sandbox is marked for recycling); a session
process killed by the code it ran is replaced on the same work directory, so the next
call works. Only a failure of the sandbox itself raises (`SandboxError`).
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import posixpath
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from sandbox import metrics
from sandbox.client import AgentConnection
from sandbox.config import MAX_TIMEOUT_S, SandboxConfig
from sandbox.errors import (
    AgentProtocolError,
    FileToolError,
    PoolClosed,
    SandboxError,
    SessionLost,
)
from sandbox.result import RunResult, Violation

RELAY_SOURCE = (Path(__file__).with_name("agent") / "relay.py").read_text()
REPLY_MARGIN_S = 15.0  # past the call's own timeout: killing, sweeping and the reply


class SessionOwner(Protocol):
    """What a session needs from the pool that handed it out (the pool imports this
    module, never the other way round)."""

    config: SandboxConfig

    @property
    def closed(self) -> bool: ...

    def taint(self, session: Session, why: str) -> None: ...

    async def reopen(self, session: Session) -> AgentConnection: ...


class Session:
    """Handed out by `SandboxPool.session()`; not shared between concurrent tasks."""

    def __init__(
        self, pool: SessionOwner, sandbox: Any, sid: str, connection: AgentConnection
    ) -> None:
        # ``sandbox`` is the owner's record of where this session lives, opaque here
        self.pool, self.sandbox, self.id, self.connection = pool, sandbox, sid, connection
        self._lost = False
        self.closed = False  # set by the pool on release: a closed session refuses calls
        self.bridge: str | None = None  # the host socket its calls reach (socket-dir name)
        # what serves that socket; the pool exits it once the session is closed
        self.bridge_stack = contextlib.AsyncExitStack()

    async def run_python(
        self,
        code: str,
        *,
        stdin: str | bytes | None = None,
        files: Mapping[str, str | bytes] | None = None,
        timeout: float | None = None,  # noqa: ASYNC109 -- the documented interface
        collect: Sequence[str] = (),
    ) -> RunResult:
        """Run Python source as ``__main__`` in the session's work dir (like ``python -c``)."""
        if not isinstance(code, str):
            raise TypeError("code must be a str")
        what = {"code": code, "mode": self.pool.config.python_mode}
        return await self._call(what, stdin, files, timeout, collect)

    async def run(
        self,
        argv: Sequence[str],
        *,
        stdin: str | bytes | None = None,
        files: Mapping[str, str | bytes] | None = None,
        timeout: float | None = None,  # noqa: ASYNC109 -- the documented interface
        collect: Sequence[str] = (),
    ) -> RunResult:
        """Execute ``argv`` (PATH lookup) in the session's work dir."""
        if isinstance(argv, str) or not argv or not all(isinstance(a, str) for a in argv):
            raise TypeError("argv must be a non-empty sequence of str")
        return await self._call({"argv": list(argv)}, stdin, files, timeout, collect)

    async def shell(
        self,
        command: str,
        *,
        timeout: float | None = None,  # noqa: ASYNC109 -- the documented interface
    ) -> RunResult:
        """Run ``command`` in the session's persistent bash (cwd, variables, history and
        background jobs carry over); stdout and stderr come back together in ``stdout``."""
        if not isinstance(command, str):
            raise TypeError("command must be a str")
        return await self._call({"op": "shell", "command": command}, None, None, timeout, ())

    async def run_bridged(
        self,
        argv: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        timeout: float | None = None,  # noqa: ASYNC109 -- the documented interface
    ) -> RunResult:
        """Run ``argv`` with ``env`` and ``OPENAI_BASE_URL`` set to a loopback port of the
        session that leads to the session's bridge (`SandboxPool.session(bridge=...)`),
        through ``sandbox.agent.relay``; stdout and stderr are the program's."""
        if self.bridge is None:
            raise ValueError("this session was opened without a bridge")
        if isinstance(argv, str) or not argv or not all(isinstance(a, str) for a in argv):
            raise TypeError("argv must be a non-empty sequence of str")
        spec = json.dumps({"argv": list(argv), "env": dict(env or {})})
        return await self.run(["python3", "-I", "-c", RELAY_SOURCE], stdin=spec, timeout=timeout)

    async def read_file(self, path: str) -> bytes:
        """A work-dir file's contents, at most the collect cap; `FileToolError` if unreadable."""
        reply = await self._file({"action": "read", "path": _relative(path)})
        return base64.b64decode(reply["data"])

    async def write_file(self, path: str, data: str | bytes) -> None:
        """Create or replace a work-dir file (parent directories are made)."""
        await self._file({"action": "write", "path": _relative(path), "data": _b64(data)})

    async def edit_file(self, path: str, old: str, new: str) -> None:
        """Replace the one occurrence of ``old`` with ``new``; `FileToolError` unless
        ``old`` occurs exactly once."""
        if not isinstance(old, str) or not isinstance(new, str) or not old:
            raise TypeError("old must be a non-empty str and new a str")
        await self._file({"action": "edit", "path": _relative(path), "old": old, "new": new})

    async def list_dir(self, path: str = ".") -> list[str]:
        """Names in a work-dir directory, sorted; directories end in ``/``."""
        where = "." if path in ("", ".") else _relative(path)
        return list((await self._file({"action": "list", "path": where}))["entries"])

    async def _file(self, request: dict[str, Any]) -> dict[str, Any]:
        if self.closed or self.pool.closed:
            raise PoolClosed(f"session {self.id} is closed")
        if self._lost:
            self.connection = await self._reopen()
        request = {"op": "file", "cap": self.pool.config.limits.collect_kb << 10, **request}
        try:
            reply = await self.connection.request(request, REPLY_MARGIN_S)
        except (OSError, TimeoutError) as exc:
            self._lost = True
            raise SessionLost(f"session {self.id} failed: {exc!r}") from exc
        if not reply.get("ok"):
            raise FileToolError(str(reply.get("error")))
        return reply

    async def _call(
        self,
        what: dict[str, Any],
        stdin: str | bytes | None,
        files: Mapping[str, str | bytes] | None,
        timeout: float | None,  # noqa: ASYNC109 -- enforced by the agent, not asyncio
        collect: Sequence[str],
    ) -> RunResult:
        if self.closed or self.pool.closed:
            raise PoolClosed(f"session {self.id} is closed")
        limits = self.pool.config.limits
        timeout_s = limits.timeout_s if timeout is None else float(timeout)
        if not 0 < timeout_s <= MAX_TIMEOUT_S:
            raise ValueError(f"timeout must be in (0, {MAX_TIMEOUT_S}] seconds")
        request = {
            "op": "run",
            **what,
            "stdin": _b64(stdin) if stdin is not None else None,
            "files": {_relative(p): _b64(d) for p, d in (files or {}).items()},
            "collect": [_relative(p) for p in collect],
            "timeout": timeout_s,
            "limits": limits.wire(timeout_s, self.pool.config.baseline_processes),
        }
        if self._lost:
            self.connection = await self._reopen()
        began = time.perf_counter()
        try:
            reply = await self.connection.request(request, timeout_s + REPLY_MARGIN_S)
        except ConnectionError:
            return await self._on_lost(time.perf_counter() - began)
        except TimeoutError as exc:
            self.pool.taint(self, "session did not answer")
            self._lost = True
            raise SessionLost(f"session {self.id} did not answer within the timeout") from exc
        except OSError as exc:
            self._lost = True
            raise SessionLost(f"session {self.id} failed: {exc!r}") from exc
        metrics.RUN_SECONDS.observe(time.perf_counter() - began)
        if not reply.get("ok"):
            raise AgentProtocolError(f"run refused: {reply.get('error')}")
        try:
            result = RunResult.from_reply(reply)
        except (KeyError, ValueError, TypeError) as exc:
            raise AgentProtocolError(f"malformed run reply: {exc!r}") from exc
        if result.violation is not Violation.NONE:
            metrics.VIOLATIONS.labels(kind=result.violation.value).inc()
            self.pool.taint(self, f"violation {result.violation.value}")
        return result

    async def _on_lost(self, duration_s: float) -> RunResult:
        """The session process died mid-call: the code killed it (or its sandbox)."""
        metrics.VIOLATIONS.labels(kind=Violation.SESSION_LOST.value).inc()
        self.pool.taint(self, "session process lost")
        self._lost = True
        return RunResult.session_lost(duration_s)

    async def _reopen(self) -> AgentConnection:
        try:
            connection = await self.pool.reopen(self)
        except (SandboxError, OSError, TimeoutError) as exc:
            raise SessionLost(f"session {self.id} is lost and cannot be reopened: {exc}") from exc
        self._lost = False
        return connection


def _b64(data: str | bytes) -> str:
    raw = data.encode() if isinstance(data, str) else bytes(data)
    return base64.b64encode(raw).decode()


def _relative(path: str) -> str:
    """A path inside the work dir; absolute paths and '..' are refused here, not remotely."""
    if not isinstance(path, str) or not path or "\x00" in path:
        raise ValueError(f"bad path {path!r}")
    norm = posixpath.normpath(path)
    if os.path.isabs(norm) or norm in (".", "..") or norm.startswith("../"):
        raise ValueError(f"path {path!r} is outside the session work directory")
    return norm
