"""Run under torchrun by tests/learner/test_lora_fsdp.py: a LoRA trainer sharded with FSDP2.

`python -m torch.distributed.run --nproc-per-node 2 -m tests.learner.fsdp_lora_job MODEL OUT`

On every rank (gloo): the tiny model with LoRA adapters, sharded; one step on the fixed batch,
the adapter's gathered gradients written by rank 0 (``OUT/grads.safetensors``, with the step's
stats); the peft adapter directory written from the shards (``OUT/adapter``) and the merged
full weights (``OUT/merged``); a checkpoint, a second step, a fresh sharded LoRA trainer
resumed from it, the same second step, and both adapters' weights
(``OUT/continued.safetensors``, ``OUT/resumed.safetensors``).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

from learner.checkpoint import LearnerState, load_training_state, save_checkpoint
from learner.distributed import DistContext, init_distributed
from learner.export import export_hf_dir
from learner.lora import merged_weights, save_adapter
from tests.learner.fsdp_job import full
from tests.learner.test_lora import lora_trainer, step


def adapter(trainer: object, grads: bool) -> dict[str, torch.Tensor]:
    return {
        n: full(p.grad if grads else p)
        for n, p in trainer.model.named_parameters()  # type: ignore[attr-defined]
        if ".lora_" in n
    }


def main(model: Path, out: Path) -> None:
    dist = init_distributed(torch.device("cpu"))
    assert dist.world == 2
    trainer = lora_trainer(model, dist=dist)
    loss = step(trainer, "first")
    grads = adapter(trainer, grads=True)
    save_adapter(trainer.model, out / "adapter", dist.is_main)
    export_hf_dir(trainer.model, out / "merged", dist.is_main, model, merged_weights(trainer.model))
    save_checkpoint(out / "ckpt", trainer.policy, trainer.optimizer, LearnerState(step=1), dist)
    step(trainer, "second")
    continued = adapter(trainer, grads=False)
    resumed = lora_trainer(model, dist=dist)
    load_training_state(out / "ckpt" / "step-00000001", resumed.policy, resumed.optimizer)
    step(resumed, "second")
    again = adapter(resumed, grads=False)
    if dist.is_main:
        save_file(grads, out / "grads.safetensors")
        save_file(continued, out / "continued.safetensors")
        save_file(again, out / "resumed.safetensors")
        (out / "stats.json").write_text(json.dumps({"loss": loss}))
    DistContext.close(dist)


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
