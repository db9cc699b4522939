"""The boundary between environments and the sandbox pool.

Environments never touch ``sandbox`` directly: they open sessions and run code
through these helpers, which translate the sandbox's own failures
(``SandboxError`` and subclasses: the pool or a container broke) into
``EnvInfraError(category=SANDBOX)`` so that workers never blame the model for
them. Code that misbehaves *inside* the sandbox (timeouts, memory, fork bombs) is
not an error here: it comes back as a ``RunResult`` with a violation, and the
environment scores it as the model's failure.

``SandboxPool`` and ``SandboxSession`` are the protocols an environment is typed
against: exactly the calls the built-in environments make. ``sandbox.SandboxPool``
satisfies them structurally (tests/envs/test_sandbox_protocol.py holds it to that).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from broker.messages import ErrorCategory
from envs.errors import EnvInfraError, EnvSpecError

if TYPE_CHECKING:  # `import envs` must not require the sandbox package at run time
    from sandbox.result import RunResult


class PythonSession(Protocol):
    """A session that runs Python source: what ``open_session`` yields."""

    async def run_python(
        self,
        code: str,
        *,
        stdin: str | bytes | None = None,
        files: Mapping[str, str | bytes] | None = None,
        timeout: float | None = None,  # noqa: ASYNC109 -- the sandbox's interface
        collect: Sequence[str] = (),
    ) -> RunResult: ...


class SandboxSession(PythonSession, Protocol):
    """One sandbox session as ``SandboxPool.session()`` hands it out."""

    async def run(
        self,
        argv: Sequence[str],
        *,
        stdin: str | bytes | None = None,
        files: Mapping[str, str | bytes] | None = None,
        timeout: float | None = None,  # noqa: ASYNC109 -- the sandbox's interface
        collect: Sequence[str] = (),
    ) -> RunResult: ...

    async def shell(
        self,
        command: str,
        *,
        timeout: float | None = None,  # noqa: ASYNC109 -- the sandbox's interface
    ) -> RunResult: ...

    async def read_file(self, path: str) -> bytes: ...

    async def write_file(self, path: str, data: str | bytes) -> None: ...

    async def edit_file(self, path: str, old: str, new: str) -> None: ...

    async def list_dir(self, path: str = ".") -> list[str]: ...


@runtime_checkable
class SandboxPool(Protocol):
    """What an environment needs from a pool: sessions, one per episode or per call."""

    def session(
        self, bridge: Callable[[Path], AbstractAsyncContextManager[object]] | None = None
    ) -> AbstractAsyncContextManager[SandboxSession]:
        """One session; ``bridge`` serves a host socket its calls reach (`sandbox.Bridge`)."""
        ...


def _sandbox_errors() -> tuple[type[BaseException], ...]:
    # Imported lazily: `import envs` must not require the sandbox package.
    from sandbox import SandboxError

    return (SandboxError,)


def require_pool(pool: SandboxPool | None, env_name: str) -> SandboxPool:
    """Check at make() time that an environment needing a sandbox was given one."""
    if pool is None or not hasattr(pool, "session"):
        raise EnvSpecError(
            f"{env_name!r} runs code in a sandbox: call envs.make(spec, sandbox=pool) with a SandboxPool"
        )
    return pool


def violated(result: RunResult) -> bool:
    """True when the sandbox reported a limit violation (timeout, memory, processes, ...)."""
    violation = getattr(result, "violation", None)
    return violation is not None and str(getattr(violation, "name", violation)).upper() != "NONE"


def violation_name(result: RunResult) -> str:
    violation = getattr(result, "violation", None)
    return str(getattr(violation, "name", violation)).lower()


@asynccontextmanager
async def open_session(pool: SandboxPool) -> AsyncIterator[PythonSession]:
    """``pool.session()`` with sandbox failures translated to ``EnvInfraError``."""
    errors = _sandbox_errors()
    try:
        async with pool.session() as sb:
            yield _TranslatingSession(sb, errors)
    except errors as exc:
        raise EnvInfraError(f"sandbox failed: {exc}", ErrorCategory.SANDBOX) from exc


class _TranslatingSession:
    """Wraps a sandbox session so that each call translates sandbox failures."""

    def __init__(self, sb: PythonSession, errors: tuple[type[BaseException], ...]) -> None:
        self._sb, self._errors = sb, errors

    async def run_python(
        self,
        code: str,
        *,
        stdin: str | bytes | None = None,
        files: Mapping[str, str | bytes] | None = None,
        timeout: float | None = None,  # noqa: ASYNC109 -- the sandbox's interface
        collect: Sequence[str] = (),
    ) -> RunResult:
        try:
            return await self._sb.run_python(
                code, stdin=stdin, files=files, timeout=timeout, collect=collect
            )
        except self._errors as exc:
            raise EnvInfraError(f"sandbox failed: {exc}", ErrorCategory.SANDBOX) from exc
