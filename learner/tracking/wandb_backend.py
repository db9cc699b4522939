"""Weights & Biases backend: offline unless it can reach a server with a key.

``--tracker-wandb-mode auto`` (the default) leaves the choice to ``WANDB_MODE`` when it
is set; otherwise the run is online when an API key is found (``WANDB_API_KEY``,
``WANDB_IDENTITY_TOKEN_FILE``, or a ``.netrc`` entry for the W&B host) and offline
when none is, which the log says. An offline run is written under
``<tracker_dir>/wandb/offline-run-*``; ``wandb sync <that dir>`` uploads it later. The
config is the run's W&B config; scalars go in the history at the learner's step; each
sample table is a `wandb.Table` logged as ``samples``. Console capture is off: the
learner's own log stays as it is.
"""

from __future__ import annotations

import json
import logging
import netrc
import os
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit

from learner.tracking.config import TrackingConfig, WandbMode
from learner.tracking.samples import SampleTable

log = logging.getLogger("learner.tracking")
DEFAULT_HOST = "https://api.wandb.ai"


def has_api_key() -> bool:
    """Whether wandb would find credentials: its variables, or a .netrc entry for the host."""
    if os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_IDENTITY_TOKEN_FILE"):
        return True
    host = urlsplit(os.environ.get("WANDB_BASE_URL", DEFAULT_HOST)).hostname or ""
    try:
        return netrc.netrc(os.environ.get("NETRC")).authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        return False


def resolve_mode(mode: WandbMode) -> str | None:
    """The mode to pass to wandb.init (None: WANDB_MODE decides)."""
    if mode is not WandbMode.AUTO:
        return mode.value
    if os.environ.get("WANDB_MODE"):
        return None
    if has_api_key():
        return WandbMode.ONLINE.value
    log.warning(
        "no W&B API key found (WANDB_API_KEY, .netrc): W&B runs offline; "
        "upload the run later with `wandb sync DIR`"
    )
    return WandbMode.OFFLINE.value


class WandbBackend:
    """One W&B run for the learner process."""

    name = "wandb"

    def __init__(self, cfg: TrackingConfig, run_name: str, config: Mapping[str, Any]) -> None:
        import wandb

        self._table = wandb.Table
        cfg.tracker_dir.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(
            project=cfg.tracker_project,
            name=run_name,
            dir=str(cfg.tracker_dir),
            config=dict(config),
            mode=resolve_mode(cfg.tracker_wandb_mode),  # type: ignore[arg-type]
            settings=wandb.Settings(console="off"),
        )
        where = os.path.dirname(self.run.dir)  # the run directory (`wandb sync` takes it)
        event = {"event": "tracker", "tracker": self.name, "mode": self.run.settings.mode}
        log.info("%s", json.dumps({**event, "dir": where}))

    def log_scalars(self, step: int, scalars: Mapping[str, float]) -> None:
        self.run.log(dict(scalars), step=step)

    def log_samples(self, table: SampleTable) -> None:
        rows = [list(row) for row in table.rows]
        samples = self._table(columns=list(table.columns), data=rows)
        self.run.log({"samples": samples}, step=table.step)

    def close(self) -> None:
        self.run.finish()
