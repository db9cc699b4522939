"""`python -m bench NAME [--quick|--smoke] [--json]`: run one benchmark, print its table.

Each benchmark is a module `bench/<NAME>.py` with `main(argv) -> int` (helpers are `_`-named).
`--smoke` runs the smallest sizes in seconds (CI runs every one: tests/bench); `--json` prints
the table to stderr and one envelope to stdout with the machine's load before and after and
whether the run held `../shared/tools/quiet`'s lock (`bench._report`).
"""

from __future__ import annotations

import importlib
import pkgutil
import sys

import bench


def available() -> list[str]:
    return sorted(
        m.name for m in pkgutil.iter_modules(bench.__path__) if not m.name.startswith("_")
    )


def main(argv: list[str]) -> int:
    names = available()
    if not argv or argv[0] in ("-h", "--help"):
        print(f"usage: python -m bench {{{','.join(names)}}} [--quick|--smoke] [--json]")
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in names:
        print(f"unknown benchmark {name!r}; choose from: {', '.join(names)}", file=sys.stderr)
        return 2
    return int(importlib.import_module(f"bench.{name}").main(rest))


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
