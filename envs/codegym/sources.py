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


@dataclass(frozen=True)
class CodeGymSource:
    """One environment's source and what static reading tells about it."""

    name: str  # registry name (the file stem)
    class_name: str  # the CodeGymEnv subclass to instantiate
    source: str  # the module text, shipped into the sandbox as <name>.py
    configs: tuple[dict[str, Any], ...]  # task configs (literal CONFIGS)
    has_solve: bool  # defines an oracle solve()


class SourceError(ValueError):
    """A source file is not a usable CodeGym environment; the message says why."""


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
    return CodeGymSource(name, cls.name, text, tuple(configs), has_solve)


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
