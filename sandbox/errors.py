"""Errors raised by the sandbox: the sandbox itself failed, never the code it ran.

    SandboxError
    ├── SandboxUnavailable   the backend (Docker engine, bwrap, image) cannot be used
    ├── ImageBuildError      the offline image build failed
    ├── AcquireTimeout       no session slot became free within the acquire timeout
    ├── SessionLost          a session's sandbox died and cannot serve further calls
    ├── AgentProtocolError   the agent answered with an error or an unreadable frame
    └── PoolClosed           the pool was used after close()

    FileToolError            a file tool failed on the model's input (missing file,
                             ambiguous edit): not a SandboxError, the model's mistake

Hostile code is not an error: it comes back as a `RunResult` with a `Violation`.
Library exceptions (docker SDK, OSError on sockets) are translated at this boundary.
"""

from __future__ import annotations


class SandboxError(Exception):
    """Base of every error the sandbox raises: infrastructure, not the model."""


class SandboxUnavailable(SandboxError):
    """The configured backend cannot run sandboxes (engine down, image missing, no bwrap)."""


class ImageBuildError(SandboxError):
    """Building the sandbox image offline failed."""


class AcquireTimeout(SandboxError):
    """No sandbox session could be acquired within the configured timeout."""


class SessionLost(SandboxError):
    """The sandbox behind a session died; open a new session."""


class AgentProtocolError(SandboxError):
    """The agent replied with an error, or the frame exchange failed."""


class PoolClosed(SandboxError):
    """The pool was used after it was closed."""


class FileToolError(Exception):
    """A file tool could not do what was asked (no such file, ``old`` not found once):
    the model's mistake, to show it as the tool's answer, never an infrastructure error."""
