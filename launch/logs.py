"""Logging set-up shared by every role process: one format, one stream, a level per role.

Lines go to stderr as ``time LEVEL logger message``; structured events are one JSON
object in the message (``{"event": "step", ...}``) so a log is both readable and
parseable. A handler already on the root logger (pytest's, or an embedding program's)
is kept: only the level changes then.
"""

from __future__ import annotations

import logging
import sys

FORMAT = "%(asctime)s %(levelname)s %(name)s %(message)s"


def setup_logging(level: str | int = "INFO") -> None:
    """Log to stderr at `level` in the farm's one format."""
    logging.basicConfig(level=level, stream=sys.stderr, format=FORMAT)
    logging.getLogger().setLevel(level)
