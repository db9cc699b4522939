"""tune_malloc keeps megabyte buffers on the heap: re-allocating one stops page-faulting. The
learner's lower threshold still does for stream entries, and gives activation-sized blocks
back to the kernel when they are freed."""

from __future__ import annotations

import subprocess
import sys

PROBE = """
import resource, sys
from broker.memory import LEARNER, tune_malloc
if sys.argv[1] == "tuned":
    assert tune_malloc()
if sys.argv[1] == "learner":
    assert tune_malloc(LEARNER)
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
    assert _faults("learner") < pages // 50  # 2 MiB entries stay under the learner's threshold


# A training step's shape: activations (argv[2] MiB each, 192 MiB in all) held together, then
# freed; the resident set after.
RESIDENT = """
import sys
from broker.memory import LEARNER, STREAMS, tune_malloc
assert tune_malloc(LEARNER if sys.argv[1] == "learner" else STREAMS)
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096
base = rss()
size = int(sys.argv[2]) << 20
held = [bytearray(size) for _ in range((192 << 20) // size)]  # touched (zero-filled)
del held
print(rss() - base)
"""


def _kept_after_free(mode: str, mib: int) -> int:
    out = subprocess.run(
        [sys.executable, "-c", RESIDENT, mode, str(mib)],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    return int(out.stdout)


def test_the_learners_freed_activations_leave_the_resident_set() -> None:
    assert _kept_after_free("broker", 8) > 48 << 20  # kept as heap (~80 MiB here)
    assert _kept_after_free("learner", 8) < 16 << 20  # each block was mapped, and unmapped
    # blocks under the learner's mmap threshold live on the heap; it trims the heap sooner
    assert _kept_after_free("broker", 2) > 48 << 20
    assert _kept_after_free("learner", 2) < 40 << 20
