"""Errors of the OpenAI-compatible routes, in vLLM 0.33's `ErrorResponse` shape.

Every rejected request is answered `{"error": {"message", "type", "param", "code"}}` with
`code` equal to the HTTP status and `type` the name vLLM gives that status (`BadRequestError`
for 400, `NotFoundError` for 404, ...), which is what the `openai` SDK turns into its own
`BadRequestError`/`NotFoundError` exceptions.
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

_TYPES = {
    400: "BadRequestError",
    401: "Unauthorized",
    404: "NotFoundError",
    422: "UnprocessableEntityError",
    500: "InternalServerError",
    501: "NotImplementedError",
    503: "ServiceUnavailableError",
}


class ApiError(Exception):
    """A request the endpoint refuses: HTTP `status` with a message naming the field."""

    def __init__(self, message: str, param: str | None = None, status: int = 400) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.status = status

    def body(self) -> dict[str, Any]:
        """The JSON body of the error response."""
        return error_payload(self.message, self.status, self.param)


def error_payload(message: str, status: int, param: str | None = None) -> dict[str, Any]:
    """vLLM's ErrorResponse: `{"error": {"message", "type", "param", "code"}}`."""
    kind = _TYPES.get(status, "BadRequestError" if status < 500 else "InternalServerError")
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


# Union members and validator kinds that pydantic puts in an error's location; not fields.
_LOC_NOISE = frozenset({"str", "int", "float", "bool", "list", "dict", "none", "tagged-union"})


def _field_path(loc: tuple[int | str, ...]) -> str:
    parts = [str(p) for p in loc if not (isinstance(p, str) and (p in _LOC_NOISE or "[" in p))]
    return ".".join(parts)


def from_validation(exc: ValidationError) -> ApiError:
    """The most specific pydantic error (the deepest location, so a union reports the member
    that got furthest) as a 400 whose `param` is the field path (`messages.1.content`)."""
    err = max(exc.errors(), key=lambda e: len(e["loc"]))
    param = _field_path(err["loc"]) or None
    return ApiError(f"{param}: {err['msg']}" if param else err["msg"], param)


def model_not_found(name: str) -> ApiError:
    """The 404 vLLM answers for a `model` it does not serve."""
    return ApiError(f"The model `{name}` does not exist.", "model", status=404)
