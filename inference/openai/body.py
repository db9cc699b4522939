"""Request bodies of every JSON route: bytes -> a JSON object -> a validated pydantic model.

One path for the CPU policy server's routes (`inference.server`, `inference.openai_routes`,
`/v1/responses`) and the worker's agent endpoint, so a malformed body, a body that is not an
object and a bad field get the same 400 everywhere, the field named as vLLM names it
(`messages.1.content`, `inference.openai.errors.from_validation`). Decoding tries orjson first
(the fast path for long conversations) and falls back to the standard library for what only it
reads (integers past 64 bits, NaN), so a too-large `seed` is refused by name, not as bad JSON.
"""

from __future__ import annotations

import json
from typing import Any, TypeVar

import orjson
from pydantic import BaseModel, ValidationError

from inference.openai.errors import ApiError, from_validation

M = TypeVar("M", bound=BaseModel)


def json_body(raw: bytes, *, allow_empty: bool = False) -> Any:
    """The decoded body (`{}` for an empty one where `allow_empty`); malformed JSON is a 400."""
    if allow_empty and not raw.strip():
        return {}
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        pass
    try:
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ApiError(f"malformed JSON body: {exc}") from None


def json_object(body: Any) -> dict[str, Any]:
    """`body` when it is a JSON object; a 400 otherwise."""
    if not isinstance(body, dict):
        raise ApiError("request body must be a JSON object")
    return body


def validate(model: type[M], body: Any) -> M:
    """`body` (decoded) as `model`; not an object, or a bad field, is a 400 naming it."""
    try:
        return model.model_validate(json_object(body))
    except ValidationError as exc:
        raise from_validation(exc) from None


def parse_body(raw: bytes, model: type[M]) -> M:
    """The raw body as `model`: decoded, checked to be an object and validated."""
    return validate(model, json_body(raw))
