"""`vllm_contract`: one stub server process carrying vLLM 0.33's own HTTP layer, per session.

The environment is built on first use (env.py, cached across runs); when it cannot be built
(no package index reachable) the suite skips locally and fails under CI. The process serves:

| app | simulates |
|---|---|
| `plain` | `vllm serve` with one GPU worker |
| `auth` | the same with `--api-key` (vLLM's AuthenticationMiddleware) |
| `tp2` | tensor parallel 2 (2 workers) |
| `pp2dp2` | pipeline parallel 2 x data parallel 2 (4 workers) |
| `lora` | one GPU worker, for the LoRA push tests that may kill its engine (stub_engine) |

Every app is started as with `--enable-lora` and `VLLM_ALLOW_RUNTIME_LORA_UPDATING=1`: vLLM's
runtime-LoRA routes and `/v1/models` over its own `OpenAIServingModels`.
| `validator` | checks bodies against vLLM's pydantic response models |
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import require
from tests.inference.vllm_contract.env import VLLM_VERSION, ensure_env, ensure_lora_router_env

API_KEY = "contract-key"
APPS = ("plain:1:1:1", f"auth:1:1:1:{API_KEY}", "tp2:2:1:1", "pp2dp2:1:2:2", "lora:1:1:1")
ROOT = Path(__file__).resolve().parents[3]


@dataclass
class VllmContract:
    """URLs of the stub server's apps, and small synchronous helpers for assertions."""

    urls: dict[str, str]

    def state(self, app: str) -> dict[str, Any]:
        """What that app's stub engine saw (calls in order, version, reloaded tensors)."""
        with urllib.request.urlopen(self.urls[app] + "/_stub/state", timeout=10) as resp:
            return json.loads(resp.read())

    def validate(self, model: str, body: Any) -> dict[str, Any]:
        """Validate `body` against vLLM's pydantic model `model` (in the vLLM process)."""
        request = urllib.request.Request(
            f"{self.urls['validator']}/validate/{model}",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=10) as resp:
            return json.loads(resp.read())


def _start(env_dirs: list[Path]) -> tuple[subprocess.Popen[str], dict[str, str]]:
    args = [sys.executable, "-m", "tests.inference.vllm_contract.stub_server"]
    for spec in APPS:
        args += ["--app", spec]
    env = os.environ | {
        "PYTHONPATH": os.pathsep.join(map(str, [*env_dirs, ROOT])),
        "VLLM_LOGGING_LEVEL": "WARNING",
        # `vllm serve` mounts /v1/load_lora_adapter and /v1/unload_lora_adapter only with it
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1",
    }
    proc = subprocess.Popen(
        args, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
    )
    urls: dict[str, str] = {}
    deadline = time.monotonic() + 240  # importing vLLM costs ~30 s of CPU
    assert proc.stdout is not None
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if line.startswith("READY-ALL"):
            return proc, urls
        if line.startswith("READY "):
            _, name, url = line.split()
            urls[name] = url
        elif not line and proc.poll() is not None:
            break
    proc.kill()
    raise RuntimeError("the vLLM contract stub server did not start")


@pytest.fixture(scope="session")
def vllm_contract() -> Iterator[VllmContract]:
    try:
        env_dirs = [ensure_env(), ensure_lora_router_env()]
    except (OSError, RuntimeError, subprocess.TimeoutExpired) as exc:
        require(False, f"the vLLM {VLLM_VERSION} contract environment ({exc})")
        raise  # unreachable: require skips or fails
    proc, urls = _start(env_dirs)
    try:
        yield VllmContract(urls)
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
        assert proc.stdout is not None
        proc.stdout.close()
