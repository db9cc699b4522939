"""scripts/gpu_sampler_check.sh, the GPU check of the tie rule, works before it reaches a GPU.

Its bundle is built from the contract environment (small enough to carry to a lent GPU
machine), and the check runs end to end in Triton's interpreter through the bundle's stand-ins
and vLLM's own top-k/top-p dispatch, finding no difference the docs do not list.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from tests.conftest import require
from tests.inference.vllm_contract.env import VLLM_VERSION, ensure_env, ensure_triton_env

ROOT = Path(__file__).resolve().parents[3]
SCRIPT = ROOT / "scripts" / "gpu_sampler_check.sh"


@pytest.mark.slow
def test_the_bundle_is_small_and_the_check_runs_interpreted(tmp_path: Path) -> None:
    try:
        ensure_env(), ensure_triton_env()
    except (OSError, RuntimeError, subprocess.TimeoutExpired) as exc:
        require(False, f"the vLLM {VLLM_VERSION} contract environment with Triton ({exc})")
    env = os.environ | {"GPU_SAMPLER_BUNDLE": str(tmp_path / "bundle")}

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["bash", str(SCRIPT), *args], env=env, capture_output=True, text=True, timeout=300
        )

    missing = run()
    assert missing.returncode == 2 and "--build" in missing.stderr
    assert run("--build").returncode == 0
    files = [f for f in (tmp_path / "bundle").rglob("*") if f.is_file()]
    assert sum(f.stat().st_size for f in files) < 20 * 2**20
    done = run("--interpret", "--only", "top-k 20", "--only", "top-p 0.9")
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    rows = [line.split() for line in done.stdout.splitlines() if line.startswith("top-")]
    assert len(rows) == 4  # two settings, two batch sizes
    assert all(row[-8:-4] == ["0", "0", "0", "0"] for row in rows), done.stdout
