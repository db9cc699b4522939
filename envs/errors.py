"""Errors raised by the environments package.

    EnvError
    ├── EnvSpecError     unknown name, bad spec string or bad kwargs given to ``envs.make``
    ├── EnvStateError    the API was misused (step before reset, step after the episode ended)
    └── EnvInfraError    infrastructure failed (sandbox, remote env server): never the model's fault

A model's bad action is *not* an exception: it is a normal observation with a low
reward, and malformed tool calls are reported in ``info["error"]`` with
``ErrorCategory.FORMAT``. Library exceptions (SandboxError, aiohttp errors) are
translated into ``EnvInfraError`` at the boundary, carrying the broker category
that workers record on the trajectory.
"""

from __future__ import annotations

from broker.messages import ErrorCategory


class EnvError(Exception):
    """Base of every error the environments package raises."""


class EnvSpecError(EnvError, ValueError):
    """An environment spec could not be resolved into an environment."""


class EnvStateError(EnvError, RuntimeError):
    """An environment was driven out of order (step before reset, after the end)."""


class EnvInfraError(EnvError):
    """The infrastructure behind an environment failed; workers must not blame the model.

    ``category`` is the broker's error category to record (``SANDBOX`` for the sandbox
    pool, ``ENV`` for a remote environment server).
    """

    def __init__(self, message: str, category: ErrorCategory = ErrorCategory.SANDBOX) -> None:
        super().__init__(message)
        self.category = category
