"""vLLM 0.33's own sampler as an oracle: processed logprobs for given logits and sampling rows.

`vllm_processed(logits, rows, temperatures)` runs `sampler_probe.py` in a process whose PYTHONPATH holds the
contract environment, and returns vLLM's processed logprobs ([N, V], -inf outside the kept set).
Skips locally and fails under CI when the environment cannot be built (`tests.conftest.require`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from broker.messages import Sampling
from tests.conftest import require
from tests.inference.vllm_contract.env import VLLM_VERSION, ensure_env

ROOT = Path(__file__).resolve().parents[3]


def _row(s: Sampling) -> dict:
    allowed = None if s.allowed_token_ids is None else s.allowed_token_ids.tolist()
    return {
        "temperature": s.temperature,
        "top_k": s.top_k,
        "top_p": s.top_p,
        "min_p": s.min_p,
        "allowed": allowed,
    }


def vllm_processed(
    logits: torch.Tensor, rows: list[Sampling], temperatures: list[float] | None = None
) -> torch.Tensor:
    """vLLM's processed logprobs of `logits` (one `Sampling` per row), -inf where dropped.
    `temperatures` are sent instead of the rows' own (a `Sampling` holds the temperature after
    vLLM's clamping; a request may ask for less)."""
    try:
        env_dir = ensure_env()
    except (OSError, RuntimeError, subprocess.TimeoutExpired) as exc:
        require(False, f"the vLLM {VLLM_VERSION} contract environment ({exc})")
        raise
    sent = [_row(s) for s in rows]
    for row, t in zip(sent, temperatures or [], strict=False):
        row["temperature"] = t
    request = {"logits": logits.float().tolist(), "rows": sent}
    env = os.environ | {"PYTHONPATH": f"{env_dir}{os.pathsep}{ROOT}", "VLLM_LOGGING_LEVEL": "ERROR"}
    done = subprocess.run(
        [sys.executable, "-m", "tests.inference.vllm_contract.sampler_probe"],
        input=json.dumps(request),
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=240,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    rows_out = json.loads(done.stdout)["logprobs"]
    return torch.tensor([[float("-inf") if v is None else v for v in r] for r in rows_out])
