"""What every benchmark prints, and the machine state that makes a figure worth quoting.

A run starts with `start(name, argv)` (load before) and ends with `emit`, which prints
the table (stdout), or with `--json` the table to stderr and one JSON envelope to stdout:
``{"bench", "argv", "machine": {"load_before", "load_after", "quiet", "cpus"}, "result"}``.
Loads are `/proc/loadavg`'s 1, 5 and 15-minute averages. `quiet` is true when the run
holds the lock of `../shared/tools/quiet`: that script takes `flock` on fd 9 opened on
its lock file (``$QUIET_LOCK``, default /tmp/rollout-farm-quiet.lock) and then execs the
command, which inherits the descriptor, so a run under quiet has that file open (a benchmark
started from Python with ``close_fds``, as ``subprocess.run`` does by default, does not
inherit it and reads as not quiet: start benchmarks from the shell under quiet).
BENCHMARKS.md quotes only runs with ``quiet`` true and a 1-minute ``load_before`` under 1.0.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DEFAULT_QUIET_LOCK = "/tmp/rollout-farm-quiet.lock"


def loadavg() -> tuple[float, float, float]:
    """The 1, 5 and 15-minute load averages."""
    one, five, fifteen = os.getloadavg()
    return round(one, 2), round(five, 2), round(fifteen, 2)


def under_quiet() -> bool:
    """Whether this process holds quiet's lock file open (inherited from `quiet`)."""
    lock = Path(os.environ.get("QUIET_LOCK", DEFAULT_QUIET_LOCK)).resolve()
    fds = Path("/proc/self/fd")
    for fd in fds.iterdir() if fds.is_dir() else ():
        try:
            if Path(os.readlink(fd)) == lock:
                return True
        except OSError:  # the descriptor closed while listing (the listing's own, say)
            continue
    return False


@dataclass(frozen=True)
class Run:
    """A benchmark run as it started."""

    name: str  # the benchmark (`python -m bench NAME`)
    argv: tuple[str, ...]  # its arguments
    load_before: tuple[float, float, float]  # 1/5/15-minute load at the start
    quiet: bool  # ran under ../shared/tools/quiet


def start(name: str, argv: list[str]) -> Run:
    return Run(name, tuple(argv), loadavg(), under_quiet())


def machine(run: Run) -> dict[str, Any]:
    """The machine record of a run, its end taken now."""
    return {
        "load_before": list(run.load_before),
        "load_after": list(loadavg()),
        "quiet": run.quiet,
        "cpus": os.cpu_count(),
    }


def machine_line(record: dict[str, Any]) -> str:
    quiet = "under quiet" if record["quiet"] else "NOT under quiet"
    return (
        f"(machine: {record['cpus']} cpus, 1-min load {record['load_before'][0]} before, "
        f"{record['load_after'][0]} after; {quiet})"
    )


def emit(run: Run, result: Any, table: str, as_json: bool) -> int:
    """Print the table and, with `as_json`, the envelope; the benchmark's exit status."""
    record = machine(run)
    text = f"{table.rstrip()}\n{machine_line(record)}"
    if as_json:
        print(text, file=sys.stderr, flush=True)
        envelope = {"bench": run.name, "argv": list(run.argv), "machine": record, "result": result}
        print(json.dumps(envelope, indent=1), flush=True)
    else:
        print(text, flush=True)
    return 0
