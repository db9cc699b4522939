"""`farm` command line: demo, up, status."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    print(f"farm {' '.join(args)}: not yet built (the local-stack issue adds it)")
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
