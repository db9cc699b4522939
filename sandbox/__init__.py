"""Isolated execution for environments: a pool of sandboxes running untrusted code.

    from sandbox import SandboxConfig, SandboxPool
    async with SandboxPool(SandboxConfig(backend="docker")) as pool:
        async with pool.session() as sb:
            r = await sb.run_python("print(1 + 1)")

Backends: Docker (default), bubblewrap, and the loudly named unsafe-no-isolation.
See docs/sandbox.md for the configuration and the security model.
"""

from sandbox.bridge import Bridge
from sandbox.config import Limits, SandboxConfig
from sandbox.errors import (
    AcquireTimeout,
    AgentProtocolError,
    FileToolError,
    ImageBuildError,
    PoolClosed,
    SandboxError,
    SandboxUnavailable,
    SessionLost,
)
from sandbox.pool import SandboxPool
from sandbox.result import RunResult, Violation
from sandbox.session import Session

__all__ = [
    "AcquireTimeout",
    "AgentProtocolError",
    "Bridge",
    "FileToolError",
    "ImageBuildError",
    "Limits",
    "PoolClosed",
    "RunResult",
    "SandboxConfig",
    "SandboxError",
    "SandboxPool",
    "SandboxUnavailable",
    "Session",
    "SessionLost",
    "Violation",
]
