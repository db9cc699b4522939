"""Errors raised by the farm command line and its supervisor.

    FarmError
    ├── ConfigError     the farm's configuration is invalid (bad flag, env var, TOML)
    ├── StartupError    a child never became ready, or a tool it needs is missing
    ├── ChildFailed     a child kept crashing past its restart budget
    ├── ImageError      an image of the compose stack could not be built
    └── LockError       a dependency lock could not be read (farm.lock)

Library exceptions (pydantic, OSError from spawning) are translated at this boundary.
"""

from __future__ import annotations


class FarmError(Exception):
    """Base of every error the farm raises."""


class ConfigError(FarmError):
    """The configuration could not be resolved; the message says which field and why."""


class StartupError(FarmError):
    """A child process could not be started or did not become ready in time."""


class ChildFailed(FarmError):
    """A child crashed more often than its restart policy allows."""


class ImageError(FarmError):
    """An image of the compose stack could not be built (`farm images build`)."""


class LockError(FarmError):
    """A dependency lock (locks/*.txt) could not be read, or does not fit this platform."""
