"""Pushing new weights to every inference server, through `inference.weight_sync`.

`WeightPusher` writes each version into `weights_dir` (default: a ``weights``
directory next to the checkpoints, or a temporary one) with an export callable
that streams the full weights from the (possibly sharded) model one gathered
tensor at a time (`learner.export`, collective under FSDP), renames the
directory into place, has every server reload it through the inference
package's file-based weight-sync client, and returns only when every server
reports the new version; anything less raises `WeightPushError`. The import is
lazy so that the CLI stays light.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from learner.config import LearnerConfig
from learner.errors import WeightPushError


@dataclass(frozen=True)
class PushResult:
    servers: tuple[str, ...]  # servers verified to serve the version
    weights_path: str  # where the weights were written
    largest_tensor_bytes: int  # the bound on the extra memory of the export


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
        self._sync_config = WeightSyncConfig(
            root_dir=self.weights_dir, api_key=cfg.inference_api_key
        )
        self._sync: Any = FileWeightSync(list(self.urls), self._sync_config)

    async def push(self, export: Callable[[Path], int], version: int) -> PushResult:
        """`export(dir)` writes a servable directory; it becomes ``v<version>`` and is loaded."""
        from inference.errors import InferenceError
        from inference.weight_sync import prune_versions

        final = self.weights_dir / f"v{version:08d}"
        tmp = self.weights_dir / f".tmp-v{version:08d}-{os.getpid()}"
        try:
            shutil.rmtree(tmp, ignore_errors=True)
            largest = export(tmp)
            shutil.rmtree(final, ignore_errors=True)
            os.replace(tmp, final)
            await self._sync.push_path(final, version)
            keep = self._sync_config.keep_versions
            await asyncio.to_thread(prune_versions, self.weights_dir, keep, final)
        except (InferenceError, OSError) as exc:  # translated at this boundary
            raise WeightPushError(f"weight push of version {version} failed: {exc}") from exc
        return PushResult(servers=self.urls, weights_path=str(final), largest_tensor_bytes=largest)

    async def close(self) -> None:
        """Nothing to release: the sync client opens one HTTP session per push."""
