"""`python -m broker show`: the command's arguments, and the step that hands it on.

Showing a group needs the learner's maths (advantages, the loss mask) and the run's
tokenizer, which sit above the broker, so the command runs in `farm.show`
(`python -m farm.show`, same arguments). `python -m broker show ...` replaces its
own process with that one (`exec_show`), with the same arguments and environment:
one command, two spellings, and no import from the broker up to the learner.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

SHOW_MODULE = "farm.show"  # where the command runs: above the learner and the workers


def add_show_command(sub: Any) -> None:
    """Register `show` on the subparsers of `python -m broker` (and of `python -m farm.show`)."""
    sh = sub.add_parser("show", help="render one trajectory group (latest, or by id) for a person")
    which = sh.add_mutually_exclusive_group()
    which.add_argument("--group", help="group id (the task id); default: the latest entry")
    which.add_argument("--entry", help="stream entry id, as `tail` prints it")
    where = sh.add_mutually_exclusive_group()
    where.add_argument(
        "--stream",
        default="trajectories",
        help="live stream (default: %(default)s, every partition's; `trajectories:2` one)",
    )
    where.add_argument("--archive", help="archive directory (`python -m broker archive --out`)")
    sh.add_argument("--tokenizer", help="model or tokenizer directory that decodes the tokens")
    sh.add_argument("--learner-config", help="the learner's TOML: model and advantage rules")
    sh.add_argument("--html", help="write a self-contained HTML page here instead of printing")


def exec_show(argv: Sequence[str]) -> NoReturn:
    """Become `python -m farm.show ARGV`: the arguments `python -m broker` was given."""
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, [sys.executable, "-m", SHOW_MODULE, *argv])
