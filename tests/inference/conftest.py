"""Fixtures of the inference tests: the tiny model, in-process servers and real server processes."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from broker.messages import Sampling
from inference.config import ServerConfig
from inference.sampling import RowSampling, processed_logits
from inference.server import PolicyServer
from inference.tiny import build_tiny_model


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "m0", seed=0)


@pytest.fixture(scope="session")
def other_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Same architecture, different weights: what a learner step would produce."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "m1", seed=1)


def teacher_forced_logprobs(
    model_path: Path, prompt: list[int], completion: list[int], sampling: Sampling | None = None
) -> torch.Tensor:
    """What the learner recomputes: one plain forward pass, then the processed distribution
    (`inference.sampling.processed_logits`: allowed mask, temperature, truncation)."""
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([prompt + completion])).logits[0].float()
    rows = logits[len(prompt) - 1 : len(prompt) - 1 + len(completion)]
    spec = RowSampling.of([sampling or Sampling()] * len(rows), rows.shape[-1])
    lp = torch.log_softmax(processed_logits(rows, spec), dim=-1)
    return lp.gather(1, torch.tensor(completion)[:, None])[:, 0]


@pytest.fixture
async def server_factory(model_dir: Path) -> AsyncIterator[Callable[..., Any]]:
    """In-process servers on loopback ports; stopped at the end of the test."""
    servers: list[PolicyServer] = []

    async def make(**overrides: Any) -> PolicyServer:
        config = ServerConfig(model=overrides.pop("model", model_dir), port=0, **overrides)
        server = PolicyServer(config)
        await server.start()
        servers.append(server)
        return server

    yield make
    for server in servers:
        await server.stop()


class ServerProcess:
    """A real `python -m inference` process; `kill()` is SIGKILL (a crash, no clean shutdown)."""

    def __init__(self, model: Path, extra: list[str]) -> None:
        args = [sys.executable, "-m", "inference", "--model", str(model), "--port", "0", *extra]
        env = os.environ | {"FARM_INFERENCE_TORCH_THREADS": "1"}
        self.proc = subprocess.Popen(
            args, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env
        )
        self.url = ""

    def wait_ready(self, timeout: float = 90) -> None:
        deadline = time.monotonic() + timeout
        assert self.proc.stdout is not None
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if line.startswith("READY "):
                self.url = line.split()[1]
                return
            if not line and self.proc.poll() is not None:
                break
        raise RuntimeError("inference server did not become ready")

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.kill()
        if self.proc.stdout is not None:
            self.proc.stdout.close()


@pytest.fixture
def process_factory(model_dir: Path) -> Iterator[Callable[..., list[ServerProcess]]]:
    started: list[ServerProcess] = []

    def make(count: int = 1, extra: list[str] | None = None) -> list[ServerProcess]:
        procs = [ServerProcess(model_dir, extra or []) for _ in range(count)]
        started.extend(procs)
        for proc in procs:  # they start in parallel; wait for each
            proc.wait_ready()
        return procs

    yield make
    for proc in started:
        proc.stop()


async def eventually(
    predicate: Callable[[], bool], within_s: float = 10.0, step: float = 0.01
) -> None:
    """Wait until `predicate()` holds (state inside a server has no event to wait on); fail on timeout."""
    for _ in range(int(within_s / step)):
        if predicate():
            return
        await asyncio.sleep(step)
    raise AssertionError("condition not reached in time")
