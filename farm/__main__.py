"""`python -m farm` is the `farm` console script."""

from farm.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
