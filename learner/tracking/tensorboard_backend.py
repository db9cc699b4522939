"""TensorBoard backend: scalars, the run config and sample tables as event files.

Files go to ``<tracker_dir>/tensorboard/<run name>`` (``tensorboard --logdir
<tracker_dir>/tensorboard``). The config is a text entry ``config`` (JSON at step 0);
each sample table is a text entry ``samples`` holding a markdown table, which
TensorBoard's Text tab renders. The writer is flushed after every call, so a write
error (a full disk) surfaces here, where the tracker contains it, and a killed learner
loses nothing it logged.
"""

from __future__ import annotations

import html
import json
import logging
import re
from collections.abc import Mapping
from typing import Any

from learner.tracking.config import TrackingConfig
from learner.tracking.samples import SampleTable

log = logging.getLogger("learner.tracking")
_MARKDOWN = re.compile(r"([\\`*_\[\]|#~])")


def cell(value: object) -> str:
    """One markdown table cell: HTML and markdown escaped, line breaks kept as <br>."""
    text = "" if value is None else str(value)
    text = _MARKDOWN.sub(r"\\\1", html.escape(text, quote=False))
    return "<br>".join(text.splitlines())  # every line break Python knows, \r and \x1c too


def markdown_table(table: SampleTable) -> str:
    """The sample table as a markdown table."""
    lines = ["| " + " | ".join(table.columns) + " |", "|" + "---|" * len(table.columns)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in table.rows]
    return "\n".join(lines)


class TensorBoardBackend:
    """Writes event files through torch's SummaryWriter (tensorboard's own format)."""

    name = "tensorboard"

    def __init__(self, cfg: TrackingConfig, run_name: str, config: Mapping[str, Any]) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.dir = cfg.tracker_dir / "tensorboard" / run_name
        self.writer = SummaryWriter(log_dir=str(self.dir))
        text = json.dumps(config, indent=2, sort_keys=True)
        self.writer.add_text("config", "    " + text.replace("\n", "\n    "), 0)  # code block
        self.writer.flush()
        log.info("%s", json.dumps({"event": "tracker", "tracker": self.name, "dir": str(self.dir)}))

    def log_scalars(self, step: int, scalars: Mapping[str, float]) -> None:
        for name, value in scalars.items():
            self.writer.add_scalar(name, value, step)
        self.writer.flush()

    def log_samples(self, table: SampleTable) -> None:
        self.writer.add_text("samples", markdown_table(table), table.step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()
