"""Errors raised by the inference package.

    InferenceError
    ├── ConfigError            the server's configuration is invalid (every problem listed)
    ├── InferenceUnavailable   no server answered within the client's retry budget
    ├── InferenceRequestError  a server rejected the request itself (HTTP 4xx); not retried
    ├── WeightSyncError        a weight push was not taken or not verified on every server
    └── EngineError            the CPU engine refused an operation (bad weights, bad state)

aiohttp and safetensors exceptions are translated at this boundary.
"""

from __future__ import annotations


class InferenceError(Exception):
    """Base of every error the inference package raises."""


class ConfigError(InferenceError, ValueError):
    """`python -m inference` was given an invalid configuration."""


class InferenceUnavailable(InferenceError):
    """No inference server produced an answer within the retry budget."""


class InferenceRequestError(InferenceError):
    """A server answered 4xx: the request is wrong, so retrying elsewhere cannot help."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status = status
        self.message = message


class WeightSyncError(InferenceError):
    """A weight push failed: `failures` maps server URL to the reason it is not serving `version`."""

    def __init__(self, version: int, failures: dict[str, str]) -> None:
        detail = "; ".join(f"{url}: {why}" for url, why in sorted(failures.items()))
        super().__init__(f"weight version {version} not served everywhere: {detail}")
        self.version = version
        self.failures = failures


class EngineError(InferenceError):
    """The CPU engine could not do what was asked; the message says why (becomes an HTTP 4xx)."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status
