"""Fixtures for the sandbox tests: real Docker engine and real bubblewrap, no mocks.

`backend` parametrises a test over docker and bwrap; `pool_factory` builds pools and
closes them (removing every container) after the test. The image is built once per
test session with the same idempotent build the test script runs.
"""

from __future__ import annotations

import contextlib
import gc
import os
import shutil
import subprocess
import time
import warnings
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest

from sandbox import SandboxConfig, SandboxPool
from tests.conftest import require

# one per pytest-xdist worker: a pool reaps the dead pools it finds there, and a test that
# plants a dead pool asserts that its own pool removed it
SOCKET_DIR = Path(f"/tmp/rf-sbx-test{os.environ.get('PYTEST_XDIST_WORKER', '')}")


def docker_available() -> bool:
    try:
        import docker
    except ImportError:
        return False
    try:
        client = docker.from_env(timeout=10)
    except docker.errors.DockerException:
        # With no engine, the SDK's version probe drops its socket unclosed: collect it here,
        # or its ResourceWarning fails whichever test the garbage collector next runs in.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ResourceWarning)
            gc.collect()
        return False
    try:
        client.ping()
        return True
    except docker.errors.DockerException:
        return False
    finally:
        client.close()


_bwrap_ok: list[bool] = []  # a probe that once worked: bwrap is there for the session


def bwrap_available() -> bool:
    """Whether bubblewrap runs here. A probe can fail for a moment while a hostile test's
    processes are still being reaped (a fork bomb's, in tests/sandbox/test_shell.py), which
    once read as "bwrap is missing": so a failed probe is tried again, and a success kept."""
    if _bwrap_ok:
        return True
    if shutil.which("bwrap") is None:
        return False
    probe = ["bwrap", "--unshare-all", "--ro-bind", "/", "/", "/usr/bin/true"]
    for attempt in range(5):
        if subprocess.run(probe, capture_output=True, check=False).returncode == 0:
            _bwrap_ok.append(True)
            return True
        time.sleep(0.5 * (attempt + 1))
    return False


_image_built: list[str] = []


def ensure_image() -> None:
    if not _image_built:
        from sandbox.image import build

        _image_built.append(build(quiet=True))


def require_backend(name: str) -> None:
    if name == "docker":
        require(docker_available(), "a Docker engine")
        ensure_image()
    elif name == "bwrap":
        require(bwrap_available(), "bubblewrap (bwrap)")


@pytest.fixture(
    params=[
        pytest.param("docker", marks=pytest.mark.docker),
        pytest.param("bwrap", marks=pytest.mark.bwrap),
    ]
)
def backend(request: pytest.FixtureRequest) -> str:
    require_backend(request.param)
    return request.param


@pytest.fixture
async def pool_factory(backend: str) -> AsyncIterator[Callable[..., Any]]:
    async with _factory(backend) as make:
        yield make


@pytest.fixture
async def docker_pool_factory() -> AsyncIterator[Callable[..., Any]]:
    """For what only Docker has: several sessions sharing one agent."""
    require_backend("docker")
    async with _factory("docker") as make:
        yield make


@contextlib.asynccontextmanager
async def _factory(backend: str) -> AsyncIterator[Callable[..., Any]]:
    pools: list[SandboxPool] = []

    async def make(**overrides: Any) -> SandboxPool:
        settings: dict[str, Any] = {
            "backend": backend,
            "warm": 1,
            "socket_dir": SOCKET_DIR,
            "health_interval_s": 60,
        }
        settings.update(overrides)
        pool = SandboxPool(SandboxConfig(**settings))
        pools.append(pool)
        await pool.start()
        return pool

    try:
        yield make
    finally:
        for pool in pools:
            await pool.close()


@pytest.fixture
async def pool(pool_factory: Callable[..., Any]) -> SandboxPool:
    return await pool_factory()
