"""`python -m farm.show`: what `python -m broker show` runs."""

from farm.show.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
