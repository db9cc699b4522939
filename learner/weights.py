"""Pushing new weights to every inference server, through `inference.weight_sync`.

`WeightPusher.push(source, version)` returns only when every server reports the new
version; anything less raises `WeightPushError`. `--weight-transfer` picks the path:

- ``file`` (default): `source.export(dir)` streams the full weights from the (possibly
  sharded) model one gathered tensor at a time (`learner.export`, collective under FSDP)
  into ``weights_dir/v<version>`` (default: a ``weights`` directory next to the
  checkpoints, or a temporary one), which is renamed into place and reloaded by every
  server through the file-based weight-sync client.
- ``nccl``: vLLM 0.33's weight-transfer routes (`NcclWeightSync`). The group of the
  learner (rank 0) and every server's workers forms at the first push (the servers are up
  by then: they produced the batch), and again at the push after a failed one (a failure
  closes it on every side; `python -m learner` stops on the `WeightPushError`, as it
  does for a failed file push, and `--resume` continues); each push broadcasts
  `source.weight_stream()`, whose tensors are gathered one at a time as they are sent.
  ``--weight-transfer-backend nccl`` uses vLLM's trainer_init (CUDA + vLLM);
  ``gloo`` is the CPU policy server's stand-in. Nothing is written to disk: the published
  `PolicyVersion.weights_path` is "".

With LoRA (`learner.lora`, file transfer only; NCCL is refused): ``--lora-export adapter``
writes each version's peft adapter directory to ``weights_dir/<run>-v<N>-<digest>`` and loads
it on every server as the adapter of that name (`learner.adapter_push`: the digest of its
files in the name, so a resumed learner's re-trained version never meets the pre-crash one),
verified by name and path; the published `PolicyVersion.adapter` names it. The run's adapters
other than it and the one pushed before are unloaded; a directory stays on disk until no
server has listed its adapter for ``--lora-adapter-keep-s``.
``--lora-export merged`` pushes full weights with the adapter merged in, as above.

The inference imports are lazy so that the CLI stays light.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from learner.config import LearnerConfig, TransferBackend, WeightTransfer
from learner.errors import ConfigError, WeightPushError
from learner.lora import LoraExport


class WeightSource(Protocol):
    """What a push reads the weights from (`learner.core.Core`)."""

    def export(self, out_dir: Path) -> int:
        """Write a servable directory; returns the largest buffer held, in bytes."""
        ...

    def weight_stream(self) -> Any:
        """An `inference.nccl.WeightStream` of the full weights (gathered as sent)."""
        ...


@dataclass(frozen=True)
class PushResult:
    servers: tuple[str, ...]  # servers verified to serve the version
    weights_path: str  # where the weights were written ("" for an NCCL-route push)
    largest_tensor_bytes: int  # the bound on the extra memory of a file export (0: NCCL)
    adapter: str = ""  # the served LoRA adapter name ("" for full weights)


class WeightPusher:
    """Push + verify on every server; `close` releases the transfer group."""

    def __init__(self, cfg: LearnerConfig) -> None:
        from inference.config import WeightSyncConfig

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
        self._sync: Any = None
        self.run = cfg.run
        self._adapters: Any = None  # a learner.adapter_push.AdapterPusher
        if cfg.lora.enabled and cfg.weight_transfer is WeightTransfer.NCCL:
            raise ConfigError(
                "--weight-transfer nccl broadcasts full weights; a LoRA run pushes its adapter "
                "(or, with --lora-export merged, merged weights) by file: use --weight-transfer file"
            )
        if cfg.lora.enabled and cfg.lora.export is LoraExport.ADAPTER:
            from learner.adapter_push import AdapterPusher

            self._adapters = AdapterPusher(
                list(self.urls), self._sync_config, cfg.run, cfg.lora.adapter_keep_s
            )
        if cfg.weight_transfer is WeightTransfer.NCCL:
            # /update_weights answers only once the broadcast is through
            timeout_s = max(self._sync_config.timeout_s, cfg.transfer.timeout_s + 60)
            self._sync = _nccl_sync(
                cfg, self._sync_config.model_copy(update={"timeout_s": timeout_s})
            )

    async def push(self, source: WeightSource, version: int) -> PushResult:
        """Move every server to `version`'s weights and verify it."""
        from inference.errors import InferenceError

        try:
            if self._sync is not None:
                if not self._sync.ready:
                    await self._sync.init()
                await self._sync.push(source.weight_stream(), version)
                return PushResult(servers=self.urls, weights_path="", largest_tensor_bytes=0)
            if self._adapters is not None:
                return await self._push_adapter(source, version)
            return await self._push_file(source, version)
        except (InferenceError, OSError) as exc:  # translated at this boundary
            raise WeightPushError(f"weight push of version {version} failed: {exc}") from exc

    async def _push_file(self, source: WeightSource, version: int) -> PushResult:
        from inference.weight_sync import FileWeightSync, prune_versions

        final = self.weights_dir / f"v{version:08d}"
        tmp = self.weights_dir / f".tmp-v{version:08d}-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        largest = source.export(tmp)
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        await FileWeightSync(list(self.urls), self._sync_config).push_path(final, version)
        keep = self._sync_config.keep_versions
        await asyncio.to_thread(prune_versions, self.weights_dir, keep, final)
        return PushResult(servers=self.urls, weights_path=str(final), largest_tensor_bytes=largest)

    async def _push_adapter(self, source: WeightSource, version: int) -> PushResult:
        name, path, written = await self._adapters.push(source, version)
        return PushResult(
            servers=self.urls, weights_path=str(path), largest_tensor_bytes=written, adapter=name
        )

    async def close(self) -> None:
        """Leave the transfer group (the file path holds nothing between pushes)."""
        if self._sync is not None:
            self._sync.close()
        if self._adapters is not None:
            await self._adapters.close()


def _nccl_sync(cfg: LearnerConfig, sync_config: Any) -> Any:
    """The NCCL-route client over the configured backend; ConfigError if it cannot run here."""
    from inference.nccl import NcclTransport, gloo_trainer_init, vllm_trainer_init
    from inference.weight_sync import NcclWeightSync

    transfer = cfg.transfer
    trainer_init: Any
    if transfer.backend is TransferBackend.NCCL:
        import torch

        if not torch.cuda.is_available():
            raise ConfigError(
                "--weight-transfer-backend nccl needs CUDA (and vLLM 0.33); "
                "use gloo with the CPU policy server"
            )
        trainer_init = vllm_trainer_init
    else:
        trainer_init = gloo_trainer_init(transfer.timeout_s)
    transport = NcclTransport(
        transfer.master_address, transfer.master_port, trainer_init=trainer_init
    )
    return NcclWeightSync(list(cfg.inference_urls), sync_config, transport)


def weight_stream(lm: Any, announce: Callable[[], None]) -> Any:
    """An `inference.nccl.WeightStream` of `lm`'s full weights, on rank 0.

    The metadata comes from the global shapes, without a gather; `announce()` (rank 0
    calling the other ranks into the gathers) runs when the sending starts."""
    from inference.nccl import WeightStream, dtype_name
    from learner.export import full_weights, weight_metadata

    meta = weight_metadata(lm)

    def produce() -> Any:
        announce()
        return full_weights(lm, main=True)

    return WeightStream(
        names=tuple(name for name, _, _ in meta),
        dtype_names=tuple(dtype_name(dtype) for _, dtype, _ in meta),
        shapes=tuple(shape for _, _, shape in meta),
        produce=produce,
    )
