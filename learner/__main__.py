"""Entry point of `python -m learner` (and of `torchrun -m learner`)."""

from __future__ import annotations

import sys

from learner.cli import main

if __name__ == "__main__":
    sys.exit(main())
