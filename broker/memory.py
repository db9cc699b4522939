"""glibc malloc settings for processes that move megabyte-sized stream entries.

glibc serves every allocation above its mmap threshold (128 KiB at start, raised only as
such blocks are freed) with a fresh mmap, and returns it to the kernel on free. A
trajectory group is 0.1-2 MB and is copied several times on its way through msgpack,
redis-py and the socket, so each copy costs a map, a page fault per 4 KiB and an unmap:
publishing 2 MB groups spent about 80 % of its CPU in the kernel (`python -m bench
broker`). Keeping such blocks on the heap, and the heap from shrinking at once, lets
freed buffers be reused. Workers, the learner and the broker CLI call this at start-up.

The learner keeps lower thresholds (`LEARNER`): its training step frees activation-sized
tensors (a `[tokens, hidden]` float32 tensor is 8 MiB at 4k tokens of a 512-wide model), which
under a 32 MiB mmap threshold stay resident as freed heap (1.3x the memory floor at 2k tokens,
1.8x at 8k; `python -m bench learner --memory`). At 4 MiB a stream entry (0.1-2 MB) is still
kept and reused, and a freed activation goes back to the kernel. Its trim threshold is 32 MiB,
a read of 8 to 16 entries of 2 MB: the 128 MiB one kept ~130-150 MiB of freed heap resident
at every sequence length.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
from dataclasses import dataclass

log = logging.getLogger(__name__)

# mallopt parameters (malloc.h)
M_TRIM_THRESHOLD = -1
M_TOP_PAD = -2
M_MMAP_THRESHOLD = -3


@dataclass(frozen=True)
class MallocSettings:
    """What `tune_malloc` sets, in bytes."""

    mmap_threshold: int  # blocks from this size up are mapped, and unmapped when freed
    trim_threshold: int  # free heap kept before giving memory back to the kernel
    top_pad: int = 16 << 20  # extra heap requested per growth, so growth is rare


# workers and the broker CLI: every entry on the heap (32 MiB is glibc's ceiling on 64-bit)
STREAMS = MallocSettings(mmap_threshold=32 << 20, trim_threshold=128 << 20)
# the learner: entries still on the heap, activations mapped, less freed heap kept
LEARNER = MallocSettings(mmap_threshold=4 << 20, trim_threshold=32 << 20)


def tune_malloc(settings: MallocSettings = STREAMS) -> bool:
    """Apply `settings`; False where the C library is not glibc (nothing changes)."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    ok = all(
        mallopt(param, value) == 1
        for param, value in (
            (M_MMAP_THRESHOLD, settings.mmap_threshold),
            (M_TRIM_THRESHOLD, settings.trim_threshold),
            (M_TOP_PAD, settings.top_pad),
        )
    )
    if not ok:
        log.warning("mallopt refused a setting; large buffers may be re-mapped on each use")
    return ok
