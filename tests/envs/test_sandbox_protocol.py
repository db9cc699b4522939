"""The environments' sandbox protocols (`envs.sandboxed`) match the real sandbox classes.

Environments are typed against `SandboxPool` / `SandboxSession`, not against the sandbox
package, so a change to a real signature must show up here and not as a TypeError in
the middle of an episode. The annotated assignment of the real pool is what a type checker
verifies (mypy: its sessions too, through `session()`'s return type).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Generic, Protocol

import pytest

import sandbox
from envs.sandboxed import PythonSession, SandboxPool, SandboxSession, _TranslatingSession


def _shape(function: Callable[..., object]) -> list[tuple[str, object, object]]:
    """Each parameter's name, kind and default: what a call site relies on."""
    return [(p.name, p.kind, p.default) for p in inspect.signature(function).parameters.values()]


def _members(protocol: type) -> list[str]:
    """The methods a protocol declares, its protocol bases' included."""
    own = [c for c in protocol.__mro__ if c not in (Protocol, Generic, object)]
    names = {n for c in own for n, v in vars(c).items() if inspect.isfunction(v)}
    return sorted(n for n in names if not n.startswith("_"))  # typing adds dunder hooks


def test_the_real_pool_is_a_sandbox_pool() -> None:
    pool: SandboxPool = sandbox.SandboxPool(sandbox.SandboxConfig(backend="bwrap"))
    assert isinstance(pool, SandboxPool)  # runtime_checkable: the members exist
    assert _shape(type(pool).session) == _shape(SandboxPool.session)


def test_the_protocols_name_what_the_environments_call() -> None:
    assert _members(SandboxPool) == ["session"]
    assert _members(PythonSession) == ["run_python"]
    assert _members(SandboxSession) == [
        "edit_file",
        "list_dir",
        "read_file",
        "run",
        "run_python",
        "shell",
        "write_file",
    ]


@pytest.mark.parametrize("name", _members(SandboxSession))
def test_the_real_session_matches_each_call(name: str) -> None:
    real = getattr(sandbox.Session, name)
    assert inspect.iscoroutinefunction(real)
    assert _shape(real) == _shape(getattr(SandboxSession, name))


def test_the_translating_session_keeps_run_pythons_shape() -> None:
    assert _shape(_TranslatingSession.run_python) == _shape(PythonSession.run_python)
    assert _shape(_TranslatingSession.run_python) == _shape(sandbox.Session.run_python)
