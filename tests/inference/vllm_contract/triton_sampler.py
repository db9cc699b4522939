"""vLLM 0.33's GPU sampling path as an oracle: its Triton kernels, run by Triton's interpreter.

`vllm_gpu_processed(logits, rows, batches, num_sm)` runs `triton_probe.py` in a process whose
PYTHONPATH holds the contract environment and Triton, and returns the temperatures vLLM's
``SamplingParams`` kept and, per emulated CUDA batch size, vLLM's processed logprobs ([N, V],
-inf outside the kept set). Skips locally and fails under CI when the environment cannot be
built (`tests.conftest.require`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from tests.conftest import require
from tests.inference.vllm_contract.env import VLLM_VERSION, ensure_env, ensure_triton_env

ROOT = Path(__file__).resolve().parents[3]


def vllm_gpu_processed(
    logits: torch.Tensor, rows: list[dict], batches: tuple[str, ...], num_sm: int
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """(the temperatures vLLM samples at, {batch: processed logprobs}) of `logits`, one request
    per row: ``{"temperature", "top_k", "top_p", "min_p", "allowed"}`` as a client sends them."""
    try:
        paths = [ensure_triton_env(), ensure_env()]
    except (OSError, RuntimeError, subprocess.TimeoutExpired) as exc:
        require(False, f"the vLLM {VLLM_VERSION} contract environment with Triton ({exc})")
        raise
    request = {
        "logits": logits.float().tolist(),
        "rows": rows,
        "batches": list(batches),
        "num_sm": num_sm,
    }
    env = os.environ | {
        "PYTHONPATH": os.pathsep.join(map(str, [*paths, ROOT])),
        "VLLM_LOGGING_LEVEL": "ERROR",
        "TRITON_INTERPRET": "1",
        "CUDA_VISIBLE_DEVICES": "",
    }
    done = subprocess.run(
        [sys.executable, "-W", "ignore", "-m", "tests.inference.vllm_contract.triton_probe"],
        input=json.dumps(request),
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    reply = json.loads(done.stdout)
    out = {
        batch: torch.tensor([[float("-inf") if v is None else v for v in r] for r in table])
        for batch, table in reply["logprobs"].items()
    }
    return reply["temperature"], out
