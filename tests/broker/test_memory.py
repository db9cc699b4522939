"""tune_malloc keeps megabyte buffers on the heap: re-allocating one stops page-faulting."""

from __future__ import annotations

import subprocess
import sys

PROBE = """
import resource, sys
from broker.memory import tune_malloc
if sys.argv[1] == "tuned":
    assert tune_malloc()
size = 2 << 20
def batch():  # a pipeline of 8 groups of 2 MiB: held together, then all freed
    held = [b"x" * size for _ in range(8)]
    del held
for _ in range(3):  # warm-up: glibc raises its thresholds, the heap grows
    batch()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(25):
    batch()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _faults(mode: str) -> int:
    out = subprocess.run(
        [sys.executable, "-c", PROBE, mode], capture_output=True, text=True, check=True, timeout=60
    )
    return int(out.stdout)


def test_large_buffers_are_reused_instead_of_remapped() -> None:
    pages = 25 * 8 * (2 << 20) // 4096
    assert _faults("default") > pages // 2  # the heap was trimmed and re-faulted each batch
    assert _faults("tuned") < pages // 50  # the same heap memory, reused
