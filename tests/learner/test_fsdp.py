"""FSDP2 under torchrun (gloo, 2 ranks, CPU) against one process on the tiny model.

* One FSDP step gives the single-process gradients (and loss, grad norm) to 1e-5, also
  with CPU offload and activation checkpointing on.
* Checkpoint (sharded, torch.distributed.checkpoint) then resume is exact: a fresh sharded
  trainer loaded from it takes the next step to bit-identical weights.
* The checkpoint's Hugging Face export, streamed from the shards in bounded buckets (also
  100-byte ones), loads with transformers and holds exactly the weights after the first step;
  so do the whole tensors a weight transfer streams (`full_weights`), also after a transfer
  stopped midway (its gathers finish, or the next collective would hang).
* A zero-advantage step is skipped by both ranks together, and moves no weight.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from learner.distributed import DistContext
from tests.learner.farm import two_rank_job
from tests.learner.split import batch_samples, make_trainer


@pytest.fixture(scope="module")
def fsdp_run(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("fsdp")
    two_rank_job("tests.learner.fsdp_job", tiny_model_dir, out)
    return out


@pytest.mark.slow
def test_one_fsdp_step_equals_the_single_process_step(fsdp_run: Path, tiny_model_dir: Path) -> None:
    trainer = make_trainer(tiny_model_dir, DistContext())
    samples = batch_samples("first")
    assert len(trainer.my_micro_batches(samples)) == 7  # 4 and 3 (+ a filler) on two ranks
    stats = trainer.step(samples, sum(int(s.loss_mask.sum()) for s in samples), len(samples))
    fsdp = json.loads((fsdp_run / "stats.json").read_text())
    assert fsdp["loss"] == pytest.approx(stats.loss, rel=1e-5, abs=1e-7)
    assert fsdp["grad_norm"] == pytest.approx(stats.grad_norm, rel=1e-5)
    assert fsdp["entropy"] == pytest.approx(stats.entropy, rel=1e-5)
    for run in ("grads", "offloaded_grads"):  # plain FSDP; CPU offload + checkpointed layers
        grads = load_file(fsdp_run / f"{run}.safetensors")
        assert len(grads) == len(list(trainer.model.named_parameters()))
        for name, p in trainer.model.named_parameters():
            torch.testing.assert_close(grads[name], p.grad, rtol=1e-5, atol=1e-7, msg=name)
    assert stats.grad_norm > 0


@pytest.mark.slow
def test_fsdp_ranks_skip_a_zero_gradient_step_together(fsdp_run: Path) -> None:
    """Both ranks skip the optimizer step of a zero-advantage batch (else the job hangs in
    its next collective) and no sharded weight moves."""
    fsdp = json.loads((fsdp_run / "stats.json").read_text())
    assert fsdp["zero_gradient_steps"] == 1
    assert fsdp["zero_moved"] == 0.0


@pytest.mark.slow
def test_fsdp_checkpoint_resume_is_exact_and_exports_a_loadable_model(fsdp_run: Path) -> None:
    from transformers import AutoModelForCausalLM

    continued = load_file(fsdp_run / "continued.safetensors")
    resumed = load_file(fsdp_run / "resumed.safetensors")
    assert continued.keys() == resumed.keys()
    for name, value in continued.items():
        assert torch.equal(value, resumed[name]), name
    export = fsdp_run / "ckpt" / "step-00000001"
    assert (export / "dcp").is_dir() and (export / "tokenizer.json").is_file()
    model = AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32)
    after_first = load_file(fsdp_run / "after_first.safetensors")
    for name, p in model.named_parameters():  # the export holds exactly the weights after step 1
        assert torch.equal(p.detach(), after_first[name]), name
    assert any(not torch.equal(after_first[n], v) for n, v in continued.items())
    for streamed_file in ("buckets", "transfer"):  # 100-byte buckets, same bytes
        streamed = load_file(fsdp_run / f"{streamed_file}.safetensors")
        assert streamed.keys() == after_first.keys() - {"lm_head.weight"}  # tied: sent once
        for name, value in streamed.items():
            assert torch.equal(value, after_first[name]), (streamed_file, name)
