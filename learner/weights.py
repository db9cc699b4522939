"""Pushing new weights to every inference server, through `inference.weight_sync`.

`WeightPusher` wraps the inference package's file-based weight-sync client:
it writes the model into `weights_dir` (default: a ``weights`` directory next
to the checkpoints, or a temporary one), has every server reload it, and
returns only when every server reports the new version; anything less raises
`WeightPushError`. The import is lazy so that the CLI stays light.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from learner.config import LearnerConfig
from learner.errors import WeightPushError


@dataclass(frozen=True)
class PushResult:
    servers: tuple[str, ...]  # servers verified to serve the version
    weights_path: str  # where the weights were written


class WeightPusher:
    """Push + verify on every server; `close` releases the client."""

    def __init__(self, cfg: LearnerConfig) -> None:
        from inference.config import WeightSyncConfig
        from inference.weight_sync import FileWeightSync

        if cfg.weights_dir is not None:
            self.weights_dir = cfg.weights_dir
        elif cfg.checkpoint_dir is not None:
            self.weights_dir = cfg.checkpoint_dir / "weights"
        else:
            self.weights_dir = Path(tempfile.mkdtemp(prefix="learner-weights-"))
        self.urls = tuple(cfg.inference_urls)
        self.tokenizer_dir = cfg.model
        sync_config = WeightSyncConfig(root_dir=self.weights_dir, api_key=cfg.inference_api_key)
        self._sync: Any = FileWeightSync(list(self.urls), sync_config)

    async def push(self, model: torch.nn.Module, version: int) -> PushResult:
        from inference.errors import InferenceError

        try:
            path = await self._sync.push(model, self.tokenizer_dir, version)
        except (InferenceError, OSError) as exc:  # translated at this boundary
            raise WeightPushError(f"weight push of version {version} failed: {exc}") from exc
        return PushResult(servers=self.urls, weights_path=str(path))

    async def close(self) -> None:
        """Nothing to release: the sync client opens one HTTP session per push."""
