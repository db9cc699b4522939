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


def from_validation(exc: ValidationError) -> ApiError:
    """The first pydantic error as a 400 naming its field path (`messages.1.content`)."""
    err = exc.errors()[0]
    param = ".".join(str(p) for p in err["loc"]) or None
    return ApiError(f"{param}: {err['msg']}" if param else err["msg"], param)


def model_not_found(name: str) -> ApiError:
    """The 404 vLLM answers for a `model` it does not serve."""
    return ApiError(f"The model `{name}` does not exist.", "model", status=404)
