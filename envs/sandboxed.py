"""The boundary between environments and the sandbox pool.

Environments never touch ``sandbox`` directly: they open sessions and run code
through these helpers, which translate the sandbox's own failures
(``SandboxError`` and subclasses: the pool or a container broke) into
``EnvInfraError(category=SANDBOX)`` so that workers never blame the model for
them. Code that misbehaves *inside* the sandbox (timeouts, memory, fork bombs) is
not an error here: it comes back as a ``RunResult`` with a violation, and the
environment scores it as the model's failure.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from broker.messages import ErrorCategory
from envs.errors import EnvInfraError, EnvSpecError


def _sandbox_errors() -> tuple[type[BaseException], ...]:
    # Imported lazily: `import envs` must not require the sandbox package.
    from sandbox import SandboxError

    return (SandboxError,)


def require_pool(pool: Any, env_name: str) -> Any:
    """Check at make() time that an environment needing a sandbox was given one."""
    if pool is None or not hasattr(pool, "session"):
        raise EnvSpecError(
            f"{env_name!r} runs code in a sandbox: call envs.make(spec, sandbox=pool) with a SandboxPool"
        )
    return pool


def violated(result: Any) -> bool:
    """True when the sandbox reported a limit violation (timeout, memory, processes, ...)."""
    violation = getattr(result, "violation", None)
    return violation is not None and str(getattr(violation, "name", violation)).upper() != "NONE"


def violation_name(result: Any) -> str:
    violation = getattr(result, "violation", None)
    return str(getattr(violation, "name", violation)).lower()


@asynccontextmanager
async def open_session(pool: Any) -> AsyncIterator[Any]:
    """``pool.session()`` with sandbox failures translated to ``EnvInfraError``."""
    errors = _sandbox_errors()
    try:
        async with pool.session() as sb:
            yield _TranslatingSession(sb, errors)
    except errors as exc:
        raise EnvInfraError(f"sandbox failed: {exc}", ErrorCategory.SANDBOX) from exc


class _TranslatingSession:
    """Wraps a sandbox session so that each call translates sandbox failures."""

    def __init__(self, sb: Any, errors: tuple[type[BaseException], ...]) -> None:
        self._sb, self._errors = sb, errors

    async def run_python(self, code: str, **kwargs: Any) -> Any:
        try:
            return await self._sb.run_python(code, **kwargs)
        except self._errors as exc:
            raise EnvInfraError(f"sandbox failed: {exc}", ErrorCategory.SANDBOX) from exc
