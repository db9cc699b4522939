"""Errors raised by the inference package.

    InferenceError
    ├── ConfigError            the server's configuration is invalid (every problem listed)
    ├── InferenceUnavailable   no server answered within the client's retry budget
    ├── InferenceRequestError  a server rejected the request itself (HTTP 4xx); not retried
    │   └── AdapterNotServed   the LoRA adapter named as `model` is not loaded (HTTP 404)
    ├── WeightSyncError        a weight push was not taken or not verified on every server
    └── EngineError            the CPU engine refused an operation (bad weights, bad state)

aiohttp and safetensors exceptions are translated at this boundary.
"""

from __future__ import annotations

import orjson

EXCERPT_CHARS = 300


class InferenceError(Exception):
    """Base of every error the inference package raises."""


class ConfigError(InferenceError, ValueError):
    """`python -m inference` was given an invalid configuration."""


class InferenceUnavailable(InferenceError):
    """No inference server produced an answer within the retry budget.

    `status` is the HTTP status of the last answer when there was one (5xx, 408, 429), else None.
    """

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class InferenceRequestError(InferenceError):
    """A server answered 4xx: the request is wrong, so retrying elsewhere cannot help."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status = status
        self.message = message


class AdapterNotServed(InferenceRequestError):
    """The server answered 404 for a LoRA adapter name: unloaded (a newer version replaced it)
    or never loaded there (a restarted server has no runtime-loaded adapters)."""

    def __init__(self, adapter: str, message: str) -> None:
        super().__init__(404, message)
        self.adapter = adapter


class WeightSyncError(InferenceError):
    """A weight push failed: `failures` maps server URL to the reason it is not serving `version`."""

    def __init__(self, version: int, failures: dict[str, str], what: str | None = None) -> None:
        detail = "; ".join(f"{url}: {why}" for url, why in sorted(failures.items()))
        super().__init__(f"{what or f'weight version {version} not served everywhere'}: {detail}")
        self.version = version
        self.failures = failures


class EngineError(InferenceError):
    """The CPU engine could not do what was asked; the message says why (becomes an HTTP 4xx)."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


def error_excerpt(body: bytes | str | None, limit: int = EXCERPT_CHARS) -> str:
    """A short, printable excerpt of a non-2xx body, whatever its shape.

    vLLM answers `{"error": {"message": ...}}` (OpenAI shape), `{"error": "Unauthorized"}` (its
    auth middleware), `{"detail": ...}` (FastAPI's HTTPException) or `{"message": ...}` (the RL
    routes); a proxy may send HTML, plain text, nothing, or broken JSON. The message is taken
    from the first shape that fits, else the raw text; never raises.
    """
    if body is None or len(body) == 0:
        return "(empty body)"
    raw = body if isinstance(body, bytes) else body.encode("utf-8", "replace")
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError:
        data = None
    message = " ".join((_message_of(data) or "").split()) if data is not None else ""
    if not message:
        message = " ".join(raw.decode("utf-8", "replace").split()) or "(blank body)"
    return message if len(message) <= limit else message[: limit - 3] + "..."


def _message_of(data: object) -> str | None:
    if isinstance(data, str):
        return data
    if not isinstance(data, dict):
        return None
    for key in ("error", "detail", "message"):
        value = data.get(key)
        if isinstance(value, dict) and isinstance(value.get("message"), str):
            return value["message"]
        if isinstance(value, str):
            return value
        if value is not None:
            return orjson.dumps(value).decode()
    return None
