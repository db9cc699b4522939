"""Tools: Python methods with type hints and docstrings, exposed as OpenAI tool schemas.

Mark a method with ``@tool``; ``tool_schemas(obj)`` returns the OpenAI
``{"type": "function", "function": {...}}`` schema of each marked method, built
from its signature (types) and docstring (the summary, and per-argument text from
a Google-style ``Args:`` section). ``invoke_tool`` validates a parsed call against
the signature and calls it; any mismatch — unknown tool, missing, extra or
mistyped argument — is a ``ToolCallError`` (a model format error, never a crash).
"""

from __future__ import annotations

import inspect
import json
import re
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import pydantic

_TOOL_MARK = "__envs_tool__"
_SCALARS: dict[Any, str] = {str: "string", int: "integer", float: "number", bool: "boolean"}


@dataclass(frozen=True)
class ToolCall:
    """One parsed tool call."""

    name: str  # tool (method) name
    # keyword arguments; a family parser (envs.toolparsers) keeps whatever JSON value the
    # model wrote, and binding a non-object fails as a ToolCallError
    arguments: dict[str, Any] = field(default_factory=dict)
    id: str = ""  # the call's id, echoed by a tool message's tool_call_id ("" when none)

    def key(self) -> str:
        """Canonical text of the call, equal for identical calls (repeat detection)."""
        return self.name + json.dumps(self.arguments, sort_keys=True, default=str)


class ToolCallError(Exception):
    """A tool call the environment cannot run; the message is shown to the model."""


def tool(method: Callable[..., Any]) -> Callable[..., Any]:
    """Mark a method as a tool the model may call."""
    setattr(method, _TOOL_MARK, True)
    return method


def _type_schema(hint: Any) -> dict[str, Any]:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint in _SCALARS:
        return {"type": _SCALARS[hint]}
    if origin is Literal:
        return {"enum": list(args)}
    if origin in (typing.Union, types.UnionType):
        inner = [a for a in args if a is not type(None)]
        schema = (
            _type_schema(inner[0])
            if len(inner) == 1
            else {"anyOf": [_type_schema(a) for a in inner]}
        )
        return {**schema, "nullable": True} if len(inner) < len(args) else schema
    if hint is list or origin in (list, tuple):
        return {"type": "array", **({"items": _type_schema(args[0])} if args else {})}
    if hint is dict or origin is dict:
        return {"type": "object"}
    return {}


def parse_docstring(doc: str) -> tuple[str, dict[str, str]]:
    """Split a docstring into its description and the ``Args:`` entries."""
    doc = inspect.cleandoc(doc or "")
    head, _, args_block = doc.partition("\nArgs:")
    args_block = re.split(r"\n(?:Returns|Raises|Yields|Examples?):", args_block)[0]
    params: dict[str, str] = {}
    current: str | None = None
    indent: int | None = None
    for line in args_block.splitlines():
        if not line.strip():
            continue
        depth = len(line) - len(line.lstrip())
        match = re.match(r"^(\w+)(?:\s*\([^)]*\))?:\s*(.*)$", line.strip())
        if match and (indent is None or depth <= indent):
            indent, current = depth, match.group(1)
            params[current] = match.group(2).strip()
        elif current is not None:
            params[current] += " " + line.strip()
    return " ".join(head.split()), params


def _tool_methods(obj: Any) -> dict[str, Callable[..., Any]]:
    found = {}
    for name in dir(type(obj)):
        attr = getattr(type(obj), name, None)
        if callable(attr) and getattr(attr, _TOOL_MARK, False):
            found[name] = getattr(obj, name)
    return found


def function_schema(method: Callable[..., Any]) -> dict[str, Any]:
    """The OpenAI tool schema of one (bound) method."""
    description, arg_docs = parse_docstring(method.__doc__ or "")
    hints = typing.get_type_hints(method)
    properties: dict[str, Any] = {}
    required: list[str] = []
    for name, param in inspect.signature(method).parameters.items():
        prop = _type_schema(hints.get(name, Any))
        if name in arg_docs:
            prop["description"] = arg_docs[name]
        properties[name] = prop
        if param.default is inspect.Parameter.empty:
            required.append(name)
    parameters = {"type": "object", "properties": properties, "required": required}
    return {
        "type": "function",
        "function": {"name": method.__name__, "description": description, "parameters": parameters},
    }


def tool_schemas(obj: Any) -> list[dict[str, Any]]:
    """Schemas of every ``@tool`` method of ``obj``, sorted by name."""
    return [function_schema(m) for _, m in sorted(_tool_methods(obj).items())]


def bind_tool_call(obj: Any, call: ToolCall) -> tuple[Callable[..., Any], dict[str, Any]]:
    """Validate ``call`` against the tool's signature; return the method and coerced kwargs."""
    methods = _tool_methods(obj)
    method = methods.get(call.name)
    if method is None:
        raise ToolCallError(f"unknown tool {call.name!r}; available: {', '.join(sorted(methods))}")
    sig = inspect.signature(method)
    try:
        sig.bind(**call.arguments)
    except TypeError as exc:
        raise ToolCallError(f"bad arguments for {call.name}: {exc}") from None
    hints = typing.get_type_hints(method)
    kwargs = {}
    for name, value in call.arguments.items():
        try:
            kwargs[name] = pydantic.TypeAdapter(hints.get(name, Any)).validate_python(value)
        except pydantic.ValidationError as exc:
            reason = exc.errors()[0]["msg"]
            raise ToolCallError(f"bad argument {name!r} for {call.name}: {reason}") from None
    return method, kwargs


def invoke_tool(obj: Any, call: ToolCall) -> Any:
    """Run a synchronous tool call on ``obj`` after validating it."""
    method, kwargs = bind_tool_call(obj, call)
    return method(**kwargs)
