"""A session's bridge: a Unix socket the host serves, which only that session's calls reach.

`SandboxPool.session(bridge=serve)` calls ``serve(path)`` before the session opens; it must
listen on a Unix socket at ``path`` (in the sandbox's socket dir) until it exits, after the
session closed. The agent opens the socket path-only and every process a `run` call of the
session starts inherits it as descriptor 5 (`sandbox.agent.call.BRIDGE_FD`);
`Session.run_bridged` turns it into a port of the session's own loopback
(`sandbox.agent.relay`). See docs/sandbox.md, "Sessions are tenants".
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from pathlib import Path

# Serves a Unix socket at the host path it is given until it exits
Bridge = Callable[[Path], AbstractAsyncContextManager[object]]


async def serve_bridge(
    stack: contextlib.AsyncExitStack, socket_dir: Path, sid: str, bridge: Bridge | None
) -> str | None:
    """Start ``bridge`` for session ``sid`` on `stack`; the socket's name in ``socket_dir``
    (None without a bridge). Exiting `stack` stops it and removes the socket."""
    if bridge is None:
        return None
    name = f"b-{sid}.sock"
    path = socket_dir / name
    stack.callback(path.unlink, missing_ok=True)  # after the bridge stopped serving
    await stack.enter_async_context(bridge(path))
    # any uid may connect: only the session's own descriptor leads to it (the socket
    # dir is closed to sessions, and hidden under their /run)
    await asyncio.to_thread(path.chmod, 0o666)
    return name
