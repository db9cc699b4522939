"""Run under torchrun by tests/learner/test_fsdp.py: FSDP2 training steps on the tiny model.

`python -m torch.distributed.run --nproc-per-node 2 -m tests.learner.fsdp_job MODEL OUT`

On every rank: a Trainer sharded with FSDP2 (gloo), one step on a fixed batch, the full
gradients gathered and written by rank 0 (``OUT/grads.safetensors``, plus the step's stats);
then the weights streamed out of the shards in tiny buckets (``OUT/buckets.safetensors``)
and gathered whole (``OUT/after_first.safetensors``), the same weights as a weight transfer
streams them, rank 1 following the learner's stream command (``OUT/transfer.safetensors``;
first a transfer stopped after two tensors, whose gathers must finish on their own), a checkpoint, a second step, a fresh trainer resumed from the checkpoint, the same
second step, and the full weights of both written (``OUT/continued.safetensors``,
``OUT/resumed.safetensors``); a zero-advantage step on the first trainer, which both ranks
skip (its count and how far the weights moved, 0, go to the stats); last, the first step again with CPU offload and activation
checkpointing on (``OUT/offloaded_grads.safetensors``). The export directory of the checkpoint is left in ``OUT/ckpt``.
"""

from __future__ import annotations

import contextlib
import json
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file
from torch.distributed.tensor import DTensor

from learner.batch import Sample
from learner.checkpoint import LearnerState, load_training_state, save_checkpoint
from learner.config import LearnerConfig
from learner.core import Core, run_follower
from learner.distributed import DistContext, init_distributed
from learner.export import full_weights, write_safetensors
from learner.trainer import Trainer
from tests.learner.split import SCALE, batch_samples, make_trainer


def full(tensor: torch.Tensor) -> torch.Tensor:
    return (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach().clone()


def gathered(trainer: Trainer, grads: bool) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in trainer.model.named_parameters():
        out[name] = full(p.grad if grads else p)  # type: ignore[arg-type]
    return out


def _totals(samples: list[Sample]) -> tuple[int, int]:
    return sum(int(s.loss_mask.sum()) for s in samples), len(samples)


def step(trainer: Trainer, samples: list[Sample]) -> dict[str, float]:
    stats = trainer.step(samples, *_totals(samples))
    return {"loss": stats.loss, "grad_norm": stats.grad_norm, "entropy": stats.entropy}


def main(model: Path, out: Path) -> None:
    dist = init_distributed(torch.device("cpu"))
    assert dist.world == 2
    first, second = batch_samples("first"), batch_samples("second")
    trainer = make_trainer(model, dist)
    stats = step(trainer, first)
    grads = gathered(trainer, grads=True)
    after_first = gathered(trainer, grads=False)
    # the streamed export in buckets far smaller than one row: many per tensor and rank
    write_safetensors(trainer.model, out / "buckets.safetensors", dist.is_main, bucket_bytes=100)
    if dist.is_main:  # a transfer that fails after two tensors; rank 1 gathers them all
        stopped = full_weights(trainer.model, main=True, bucket_bytes=100)
        next(stopped), next(stopped)
        stopped.close()
    else:
        list(full_weights(trainer.model, main=False, bucket_bytes=100))
    # a push's stream as the learner runs it: rank 0 sends, rank 1 follows the stream command
    core = Core(LearnerConfig(model=model), dist, trainer, LearnerState(step=1), None)
    if dist.is_main:
        stream = core.weight_stream()
        with contextlib.closing(stream.checked()) as sent:  # checked against the metadata
            streamed = dict(zip(stream.names, sent, strict=True))
        core.stop_followers()
    else:
        run_follower(core)
    save_checkpoint(
        out / "ckpt",
        trainer.policy,
        trainer.optimizer,
        LearnerState(step=1),
        dist,
        tokenizer_dir=model,
    )
    step(trainer, second)
    continued = gathered(trainer, grads=False)
    # a batch of zero advantages: both ranks skip the optimizer step together (a rank that
    # stepped alone would wait in its next collective forever), and nothing moves
    zero = [replace(s, advantages=np.zeros_like(s.advantages)) for s in first]
    stats["zero_gradient_steps"] = trainer.step(zero, *_totals(zero)).zero_gradient_steps
    stats["zero_moved"] = max(
        float((w - continued[name]).abs().max())
        for name, w in gathered(trainer, grads=False).items()
    )
    resumed = make_trainer(model, dist)
    load_training_state(out / "ckpt" / "step-00000001", resumed.policy, resumed.optimizer)
    step(resumed, second)
    again = gathered(resumed, grads=False)
    options = replace(SCALE, cpu_offload=True, activation_checkpointing=True)
    offloaded = make_trainer(model, dist, options)
    step(offloaded, first)
    offloaded_grads = gathered(offloaded, grads=True)
    if dist.is_main:
        save_file(offloaded_grads, out / "offloaded_grads.safetensors")
        save_file(grads, out / "grads.safetensors")
        save_file(after_first, out / "after_first.safetensors")
        save_file(streamed, out / "transfer.safetensors")
        save_file(continued, out / "continued.safetensors")
        save_file(again, out / "resumed.safetensors")
        (out / "stats.json").write_text(json.dumps(stats))
    DistContext.close(dist)


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
