"""LoRA under FSDP2 (torchrun, gloo, 2 ranks, CPU) against one process on the tiny model.

* One sharded step gives the single-process adapter gradients and loss (to 1e-5).
* The adapter and the merged weights written from the shards load in peft and transformers
  and give the single-process model's logits.
* Checkpoint then resume is exact: the next step reaches bit-identical adapter weights.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.learner.farm import two_rank_job
from tests.learner.test_lora import lora_trainer, step


@pytest.fixture(scope="module")
def lora_fsdp_run(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("lora-fsdp")
    two_rank_job("tests.learner.fsdp_lora_job", tiny_model_dir, out)
    return out


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")
def test_a_sharded_lora_step_equals_the_single_process_step(
    lora_fsdp_run: Path, tiny_model_dir: Path
) -> None:
    import peft
    from transformers import AutoModelForCausalLM

    trainer = lora_trainer(tiny_model_dir)
    loss = step(trainer, "first")
    assert json.loads((lora_fsdp_run / "stats.json").read_text())["loss"] == pytest.approx(
        loss, abs=1e-6
    )
    grads = load_file(lora_fsdp_run / "grads.safetensors")
    mine = {n: p.grad for n, p in trainer.model.named_parameters() if ".lora_" in n}
    assert set(grads) == set(mine) and len(mine) == 16
    for name, grad in mine.items():
        torch.testing.assert_close(grads[name], grad, atol=1e-5, rtol=1e-5)
    ids = torch.tensor([[1, 5, 9, 42, 7, 3]])
    want = trainer.model(input_ids=ids).logits
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    loaded = peft.PeftModel.from_pretrained(base, lora_fsdp_run / "adapter").eval()
    torch.testing.assert_close(loaded(input_ids=ids).logits, want, atol=1e-5, rtol=1e-5)
    merged = AutoModelForCausalLM.from_pretrained(lora_fsdp_run / "merged", dtype=torch.float32)
    torch.testing.assert_close(merged(input_ids=ids).logits, want, atol=1e-5, rtol=1e-5)


@pytest.mark.slow
def test_sharded_lora_resume_is_exact(lora_fsdp_run: Path) -> None:
    continued = load_file(lora_fsdp_run / "continued.safetensors")
    resumed = load_file(lora_fsdp_run / "resumed.safetensors")
    assert set(continued) == set(resumed) and continued
    for name, tensor in continued.items():
        assert torch.equal(tensor, resumed[name]), name
