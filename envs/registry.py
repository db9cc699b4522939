"""The environment registry: names to factories, and spec strings to environments.

A spec is ``name`` or ``name@{json kwargs}``. ``make`` resolves the name (built-in
environments are imported lazily, so ``import envs`` stays cheap), validates the
kwargs against the factory and returns a fresh environment. Every failure to build
one — unknown name, malformed JSON, unknown or invalid kwargs — is an
``EnvSpecError`` whose one-line message says what was wrong and what is accepted.
``check_spec`` runs the same checks without building anything (no sandbox, no
I/O): against the factory's signature and, for factories marked with
``spec_config(Model)``, against that pydantic model.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import json
import re
from collections.abc import Callable
from typing import Any, TypeVar

import pydantic

from envs.errors import EnvSpecError
from envs.sandboxed import SandboxPool

Factory = Callable[..., Any]
F = TypeVar("F", bound=Factory)

_CONFIG_ATTR = "__spec_config__"  # the pydantic model a factory's kwargs are the fields of

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:/-]*$")

# Built-ins resolve on first use: "module:attribute" of the factory.
_BUILTINS: dict[str, str] = {
    "toy": "envs.toy:make_toy",
    "lookup": "envs.lookup:make_lookup",
    "arith": "envs.arith:make_arith",
    "calc": "envs.calc:make_calc",
    "http": "envs.http:make_http_env",
    "code": "envs.code:make_code_env",
    "codegym": "envs.codegym:make_codegym_env",
    "stateful": "envs.stateful:make_stateful_env",
    "agent": "envs.agent:make_agent_env",
    "terminal": "envs.terminal:make_terminal_env",
    "dataset": "envs.dataset:make_dataset_env",
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
        raise _bad_kwargs(name, factory, exc) from exc
    return "sandbox" in params


# Workers make an environment per episode, from a handful of specs: bind each shape once.
_cached_bind = functools.lru_cache(maxsize=1024)(_bind)


def spec_config(model: type[pydantic.BaseModel]) -> Callable[[F], F]:
    """Mark a factory whose spec kwargs are the fields of ``model``, so that
    ``check_spec`` validates them without calling the factory."""

    def mark(factory: F) -> F:
        setattr(factory, _CONFIG_ATTR, model)
        return factory

    return mark


def _config_model(factory: Factory) -> type[pydantic.BaseModel] | None:
    model = getattr(factory, _CONFIG_ATTR, None)
    return model if isinstance(model, type) and issubclass(model, pydantic.BaseModel) else None


def _accepted(factory: Factory) -> str:
    """The kwargs a spec may give, required ones marked: for error messages."""
    model = _config_model(factory)
    if model is not None:
        fields = [(n, f.is_required()) for n, f in model.model_fields.items()]
    else:
        sig = _signature(factory)
        params = sig.parameters.values() if sig is not None else ()
        fields = [
            (p.name, p.default is p.empty)
            for p in params
            if p.name != "sandbox" and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
        ]
    return ", ".join(f"{n} (required)" if req else n for n, req in fields) or "none"


def _one_line(exc: pydantic.ValidationError) -> str:
    parts = []
    for err in exc.errors(include_url=False):
        where = ".".join(str(x) for x in err["loc"]) or "kwargs"
        parts.append(f"{where}: {err['msg']}")
    return "; ".join(parts)


def _bad_kwargs(name: str, factory: Factory, problem: object) -> EnvSpecError:
    return EnvSpecError(
        f"bad kwargs for {name!r}: {problem}; accepted kwargs: {_accepted(factory)}"
    )


def check_spec(spec: str) -> tuple[str, dict[str, Any]]:
    """Validate a spec as ``make`` would, without building the environment.

    Returns ``(name, kwargs)``; raises ``EnvSpecError`` (one line: the problem and
    the accepted kwargs). Importing a lazily registered factory is the only side
    effect. Checks that need the environment itself (a file a kwarg names, a
    codegym source admitted on the worker) are left to ``make``.
    """
    name, kwargs = parse_spec(spec)
    factory = _resolve(name)
    _check_kwargs(name, factory, kwargs)
    model = _config_model(factory)
    if model is not None:
        try:
            model.model_validate(kwargs)
        except pydantic.ValidationError as exc:
            raise _bad_kwargs(name, factory, _one_line(exc)) from None
    return name, kwargs


def make(spec: str, *, sandbox: SandboxPool | None = None) -> Any:
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
    except pydantic.ValidationError as exc:
        raise _bad_kwargs(name, factory, _one_line(exc)) from exc
    except ValueError as exc:
        raise _bad_kwargs(name, factory, exc) from exc
