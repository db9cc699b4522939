"""Fixtures for the worker tests: real CPU policy servers and real worker processes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import free_port

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Proc:
    """A child process the test owns; killed by pid at teardown."""

    process: subprocess.Popen[bytes]
    log: Path
    url: str = ""

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(10)

    def terminate(self) -> int:
        self.process.send_signal(signal.SIGTERM)
        return self.process.wait(60)

    def output(self) -> str:
        return self.log.read_text(errors="replace")


def _wait_healthy(proc: Proc, timeout: float = 90.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.process.poll() is not None:
            raise RuntimeError(f"policy server exited: {proc.output()[-2000:]}")
        try:
            with urllib.request.urlopen(proc.url + "/health", timeout=1) as resp:
                if resp.status == 200:
                    return
        except OSError:
            time.sleep(0.2)
    raise RuntimeError("policy server did not become healthy")


def _spawn(args: list[str], log: Path) -> subprocess.Popen[bytes]:
    """Output goes to a file: a full pipe would block the child."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    with log.open("wb") as out:
        return subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, env=env)


def start_policy_server(model: Path, logs: Path) -> Proc:
    """`python -m inference` on `model` at a free port, once healthy; the caller kills it."""
    port = free_port()
    args = [sys.executable, "-m", "inference", "--model", str(model), "--host", "127.0.0.1"]
    log = logs / f"server-{port}.log"
    proc = Proc(_spawn([*args, "--port", str(port)], log), log, f"http://127.0.0.1:{port}")
    _wait_healthy(proc)
    return proc


@pytest.fixture(scope="session")
def policy_server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proc]:
    """One CPU policy server (python -m inference) shared by the worker tests."""
    proc = start_policy_server(tiny_model_dir, tmp_path_factory.mktemp("server"))
    yield proc
    proc.kill()


@pytest.fixture
def server_factory(tiny_model_dir: Path, tmp_path: Path) -> Iterator[Callable[[], Proc]]:
    made: list[Proc] = []

    def make() -> Proc:
        made.append(start_policy_server(tiny_model_dir, tmp_path))
        return made[-1]

    yield make
    for proc in made:
        proc.kill()


@pytest.fixture
def worker_factory(tiny_model_dir: Path, tmp_path: Path) -> Iterator[Callable[..., Proc]]:
    """Start `python -m workers` subprocesses; each is killed (by pid) at teardown."""
    made: list[Proc] = []

    def make(redis_url: str, run: str, urls: list[str], *extra: str) -> Proc:
        args = [
            sys.executable,
            "-m",
            "workers",
            "--redis-url",
            redis_url,
            "--run",
            run,
            "--inference-urls",
            ",".join(urls),
            "--model",
            str(tiny_model_dir),
            "--env-modules",
            "tests.workers.testenvs",
            "--max-tokens",
            "6",
            "--inference-request-timeout-s",
            "10",
            "--inference-retry-budget-s",
            "20",
            *extra,
        ]
        log = tmp_path / f"worker-{len(made)}.log"
        made.append(Proc(_spawn(args, log), log))
        return made[-1]

    yield make
    for proc in made:
        proc.kill()
