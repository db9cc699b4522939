"""The environment registry: names to factories, and spec strings to environments.

A spec is ``name`` or ``name@{json kwargs}``. ``make`` resolves the name (built-in
environments are imported lazily, so ``import envs`` stays cheap), validates the
kwargs against the factory and returns a fresh environment. Every failure to build
one — unknown name, malformed JSON, unknown or invalid kwargs — is an
``EnvSpecError`` whose message says what was wrong and what is accepted.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import json
import re
from collections.abc import Callable
from typing import Any

import pydantic

from envs.errors import EnvSpecError

Factory = Callable[..., Any]

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:/-]*$")

# Built-ins resolve on first use: "module:attribute" of the factory.
_BUILTINS: dict[str, str] = {
    "toy": "envs.toy:make_toy",
    "lookup": "envs.lookup:make_lookup",
    "http": "envs.http:make_http_env",
    "code": "envs.code:make_code_env",
    "codegym": "envs.codegym:make_codegym_env",
    "stateful": "envs.stateful:make_stateful_env",
}
_registry: dict[str, Factory | str] = dict(_BUILTINS)


def register(name: str, factory: Factory | str, *, overwrite: bool = False) -> None:
    """Register ``factory`` (a callable, or a lazy ``"module:attr"`` path) under ``name``.

    The factory is called with the spec's kwargs, plus ``sandbox=pool`` when it
    accepts a ``sandbox`` parameter. Re-registering a name needs ``overwrite=True``.
    """
    if not isinstance(name, str) or not _NAME.match(name) or "@" in name:
        raise EnvSpecError(f"invalid environment name {name!r}: use letters, digits, _ . : / -")
    if not (callable(factory) or (isinstance(factory, str) and ":" in factory)):
        raise EnvSpecError(f"factory for {name!r} must be callable or 'module:attr'")
    if name in _registry and not overwrite:
        raise EnvSpecError(f"environment {name!r} is already registered (pass overwrite=True)")
    _registry[name] = factory


def registered() -> list[str]:
    """Sorted names of every registered environment, built-ins included."""
    return sorted(_registry)


def parse_spec(spec: str) -> tuple[str, dict[str, Any]]:
    """Split ``name@{json}`` into the name and its kwargs dict."""
    if not isinstance(spec, str) or not spec.strip():
        raise EnvSpecError(f"environment spec must be a non-empty string, got {spec!r}")
    name, sep, raw = spec.strip().partition("@")
    name = name.strip()
    if not sep:
        return name, {}
    try:
        kwargs = json.loads(raw) if raw.strip() else {}
    except (ValueError, RecursionError) as exc:
        raise EnvSpecError(f"kwargs of spec {spec!r} are not valid JSON: {exc}") from exc
    if not isinstance(kwargs, dict):
        raise EnvSpecError(
            f"kwargs of spec {spec!r} must be a JSON object, got {type(kwargs).__name__}"
        )
    return name, kwargs


def _resolve(name: str) -> Factory:
    try:
        entry = _registry[name]
    except KeyError:
        raise EnvSpecError(
            f"unknown environment {name!r}; registered: {', '.join(registered())}"
        ) from None
    if callable(entry):
        return entry
    module_name, _, attr = entry.partition(":")
    try:
        factory = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise EnvSpecError(
            f"environment {name!r} could not be loaded from {entry!r}: {exc}"
        ) from exc
    _registry[name] = factory
    return factory


def _uncached_signature(factory: Factory) -> inspect.Signature | None:
    try:
        return inspect.signature(factory)
    except (TypeError, ValueError):
        return None


# inspect.signature costs ~0.2 ms, and workers make an environment per episode.
_cached_signature = functools.lru_cache(maxsize=256)(_uncached_signature)


def _signature(factory: Factory) -> inspect.Signature | None:
    try:
        return _cached_signature(factory)
    except TypeError:  # an unhashable factory object
        return _uncached_signature(factory)


def _check_kwargs(name: str, factory: Factory, kwargs: dict[str, Any]) -> bool:
    """Bind kwargs to the factory's signature; return whether it takes ``sandbox``."""
    if "sandbox" in kwargs:
        raise EnvSpecError(f"'sandbox' cannot be given in the spec of {name!r}; pass sandbox=")
    try:
        return _cached_bind(name, factory, tuple(kwargs))
    except TypeError as exc:  # an unhashable factory object
        if "unhashable" not in str(exc):
            raise
        return _bind(name, factory, tuple(kwargs))


def _bind(name: str, factory: Factory, names: tuple[str, ...]) -> bool:
    sig = _signature(factory)
    if sig is None:
        return False
    params = sig.parameters
    try:  # binding checks names and required parameters only, so the names decide it
        sig.bind(**dict.fromkeys(names))
    except TypeError as exc:
        accepted = [p for p in params if p != "sandbox"]
        raise EnvSpecError(f"bad kwargs for {name!r}: {exc}; accepted: {accepted}") from exc
    return "sandbox" in params


# Workers make an environment per episode, from a handful of specs: bind each shape once.
_cached_bind = functools.lru_cache(maxsize=1024)(_bind)


def make(spec: str, *, sandbox: Any = None) -> Any:
    """Build the environment a spec names; ``sandbox`` (a SandboxPool) goes to envs that take one."""
    name, kwargs = parse_spec(spec)
    factory = _resolve(name)
    takes_sandbox = _check_kwargs(name, factory, kwargs)
    if takes_sandbox:
        kwargs = {**kwargs, "sandbox": sandbox}
    try:
        return factory(**kwargs)
    except EnvSpecError:
        raise
    except (pydantic.ValidationError, ValueError) as exc:
        raise EnvSpecError(f"bad kwargs for {name!r}: {exc}") from exc
