"""CodeGym environment sources: discovering them without running them.

The host never imports an environment's code: it reads the file with ``ast`` to
find the ``CodeGymEnv`` subclass, its literal ``CONFIGS`` and whether it has an
oracle ``solve()``. The code itself only ever runs in the sandbox. Built-in
sources live in ``envs/codegym/library/``; user directories are added through
``envs.codegym.loader.load_directory``, which admits a source only after it has
proved itself in the sandbox.
"""

from __future__ import annotations

import ast
import functools
from dataclasses import dataclass
from importlib import resources
from typing import Any

from envs.errors import EnvSpecError
from envs.tools import parse_docstring

_AST_TYPES = {"str": "string", "int": "integer", "float": "number", "bool": "boolean"}


@dataclass(frozen=True)
class CodeGymSource:
    """One environment's source and what static reading tells about it."""

    name: str  # registry name (the file stem)
    class_name: str  # the CodeGymEnv subclass to instantiate
    source: str  # the module text, shipped into the sandbox as <name>.py
    configs: tuple[dict[str, Any], ...]  # task configs (literal CONFIGS)
    has_solve: bool  # defines an oracle solve()
    tools: tuple[dict[str, Any], ...] = ()  # OpenAI schemas, read statically from the source


class SourceError(ValueError):
    """A source file is not a usable CodeGym environment; the message says why."""


def _annotation_schema(node: ast.expr | None) -> dict[str, Any]:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):  # a string annotation
        try:
            node = ast.parse(node.value, mode="eval").body
        except SyntaxError:
            return {}
    if isinstance(node, ast.Name):
        if node.id in _AST_TYPES:
            return {"type": _AST_TYPES[node.id]}
        return (
            {"type": "array"}
            if node.id == "list"
            else {"type": "object"}
            if node.id == "dict"
            else {}
        )
    if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name):
        if node.value.id == "list":
            return {"type": "array", "items": _annotation_schema(node.slice)}
        if node.value.id == "dict":
            return {"type": "object"}
    return {}


def _tool_schema(fn: ast.FunctionDef) -> dict[str, Any]:
    """The OpenAI schema of a ``@tool`` method, from its AST alone."""
    description, arg_docs = parse_docstring(ast.get_docstring(fn) or "")
    args = fn.args
    positional = args.args[1:]  # drop self
    first_default = len(positional) - len(args.defaults)
    properties: dict[str, Any] = {}
    required: list[str] = []
    params = [(a, i < first_default) for i, a in enumerate(positional)]
    params += [(a, d is None) for a, d in zip(args.kwonlyargs, args.kw_defaults, strict=True)]
    for arg, is_required in params:
        prop = _annotation_schema(arg.annotation)
        if arg.arg in arg_docs:
            prop["description"] = arg_docs[arg.arg]
        properties[arg.arg] = prop
        if is_required:
            required.append(arg.arg)
    parameters = {"type": "object", "properties": properties, "required": required}
    return {
        "type": "function",
        "function": {"name": fn.name, "description": description, "parameters": parameters},
    }


def _class_tools(cls: ast.ClassDef) -> dict[str, dict[str, Any]]:
    return {
        fn.name: _tool_schema(fn)
        for fn in cls.body
        if isinstance(fn, ast.FunctionDef)
        and any(isinstance(d, ast.Name) and d.id == "tool" for d in fn.decorator_list)
    }


def read_source(name: str, text: str) -> CodeGymSource:
    """Statically inspect ``text``; raise ``SourceError`` when it is not an environment."""
    if not name.isidentifier() or name == "codegym_runtime":
        raise SourceError(f"{name!r} is not a valid module name")
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError, RecursionError, MemoryError) as exc:
        raise SourceError(f"does not parse: {exc}") from None
    classes = [
        node
        for node in tree.body
        if isinstance(node, ast.ClassDef)
        and any(isinstance(b, ast.Name) and b.id == "CodeGymEnv" for b in node.bases)
    ]
    if len(classes) != 1:
        raise SourceError(f"needs exactly one CodeGymEnv subclass, found {len(classes)}")
    cls = classes[0]
    configs: Any = None
    for stmt in cls.body:
        if isinstance(stmt, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "CONFIGS" for t in stmt.targets
        ):
            try:
                configs = ast.literal_eval(stmt.value)
            except (ValueError, TypeError, SyntaxError, RecursionError) as exc:
                raise SourceError(f"CONFIGS must be a literal: {exc}") from None
    if (
        not isinstance(configs, list)
        or not configs
        or not all(isinstance(c, dict) for c in configs)
    ):
        raise SourceError("CONFIGS must be a non-empty list of dicts")
    has_solve = any(isinstance(f, ast.FunctionDef) and f.name == "solve" for f in cls.body)
    tools = {**_base_tools(), **_class_tools(cls)}
    return CodeGymSource(
        name, cls.name, text, tuple(configs), has_solve, tuple(v for _, v in sorted(tools.items()))
    )


@functools.cache
def _base_tools() -> dict[str, dict[str, Any]]:
    """Tools every environment inherits from the runtime's ``CodeGymEnv`` (``Done``)."""
    tree = ast.parse(runtime_source())
    base = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "CodeGymEnv")
    return _class_tools(base)


def _builtin_sources() -> dict[str, CodeGymSource]:
    found = {}
    for entry in resources.files("envs.codegym.library").iterdir():
        if entry.name.endswith(".py") and not entry.name.startswith("_"):
            name = entry.name[:-3]
            found[name] = read_source(name, entry.read_text())
    return found


_library: dict[str, CodeGymSource] = {}


def library() -> dict[str, CodeGymSource]:
    """Every known environment source: built-ins plus admitted user sources."""
    if not _library:
        _library.update(_builtin_sources())
    return _library


def add_source(source: CodeGymSource) -> None:
    """Make an admitted source available to ``codegym@{"env": name}``."""
    current = library()
    if source.name in _builtin_sources():
        raise SourceError(f"{source.name!r} would shadow a built-in environment")
    current[source.name] = source


def get_source(name: str) -> CodeGymSource:
    try:
        return library()[name]
    except KeyError:
        raise EnvSpecError(
            f"unknown codegym environment {name!r}; known: {sorted(library())}"
        ) from None


@functools.cache
def runtime_source() -> str:
    """Text of the in-sandbox runtime module."""
    return resources.files("envs.codegym").joinpath("codegym_runtime.py").read_text()
