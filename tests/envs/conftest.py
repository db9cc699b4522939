"""Sandbox pools for the environment tests: bubblewrap for speed, Docker where marked."""

from __future__ import annotations

import shutil
from collections.abc import AsyncIterator
from typing import Any

import pytest

from tests.conftest import require


async def _pool(backend: str) -> Any:
    require(_has_pool(), "the sandbox package (SandboxPool)")
    from sandbox import SandboxConfig, SandboxPool, SandboxUnavailable

    pool = SandboxPool(SandboxConfig(backend=backend))
    try:
        await pool.start()
    except SandboxUnavailable as exc:  # e.g. the image is not built: skip locally, fail in CI
        await pool.close()
        require(False, f"a working {backend} sandbox ({exc})")
    return pool


def _has_pool() -> bool:
    try:
        from sandbox import SandboxPool  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.fixture
async def bwrap_pool() -> AsyncIterator[Any]:
    require(shutil.which("bwrap") is not None, "bubblewrap (bwrap)")
    pool = await _pool("bwrap")
    try:
        yield pool
    finally:
        await pool.close()


@pytest.fixture
async def docker_pool() -> AsyncIterator[Any]:
    require(shutil.which("docker") is not None, "a Docker engine")
    pool = await _pool("docker")
    try:
        yield pool
    finally:
        await pool.close()
