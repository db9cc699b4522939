"""`python -m tests.learner.exit_probe ARGS...`: `python -m learner ARGS...`, then, as the
interpreter is about to exit, one stderr line naming the process's threads:
``exit-probe rank <RANK> threads ["python", ...]`` (Linux: /proc/self/task/*/comm)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from learner.cli import main


def thread_names() -> list[str]:
    names = []
    for task in sorted(Path("/proc/self/task").iterdir()):
        try:
            names.append((task / "comm").read_text().strip())
        except OSError:  # the thread ended while we looked
            continue
    return names


if __name__ == "__main__":
    code = main(sys.argv[1:])
    rank = os.environ.get("RANK", "0")
    line = f"\nexit-probe rank {rank} threads {json.dumps(thread_names())}\n"
    # one write(2) under PIPE_BUF: the ranks share torchrun's stderr, whole lines never mix
    os.write(sys.stderr.fileno(), line.encode())
    sys.exit(code)
