"""Checkpoints: complete or absent, LATEST always names a complete one, old ones pruned."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from learner.checkpoint import (
    LearnerState,
    latest_checkpoint,
    load_state,
    load_training_state,
    save_checkpoint,
)
from learner.distributed import DistContext
from learner.errors import CheckpointError
from learner.policy import PolicyModel

ONE = DistContext()


def test_save_load_prune_and_crash_leftovers(tiny_model_dir: Path, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    policy = PolicyModel(model, chunk_tokens=16)
    opt = torch.optim.AdamW(policy.parameters(), lr=1e-3)
    model(input_ids=torch.tensor([[1, 2, 3]])).logits.sum().backward()
    opt.step()
    root = tmp_path / "ckpt"
    assert latest_checkpoint(root) is None
    state = LearnerState()
    for step in (1, 2, 3):
        state.step = step
        state.record_step([f"g{step}"])
        path = save_checkpoint(root, policy, opt, state, ONE, tokenizer_dir=tiny_model_dir, keep=2)
    assert latest_checkpoint(root) == path == root / "step-00000003"
    assert sorted(p.name for p in root.glob("step-*")) == ["step-00000002", "step-00000003"]
    assert load_state(path).trained == [["g1"], ["g2"], ["g3"]]
    # a checkpoint is a servable model directory
    served = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    for (k, a), b in zip(model.state_dict().items(), served.state_dict().values(), strict=True):
        assert torch.equal(a, b), k
    assert (path / "tokenizer.json").is_file()
    fresh_model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    fresh = PolicyModel(fresh_model, chunk_tokens=16)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-3)
    load_training_state(path, fresh, fresh_opt)
    for a, b in zip(policy.parameters(), fresh.parameters(), strict=True):
        assert torch.equal(a, b)
    for a, b in zip(opt.state.values(), fresh_opt.state.values(), strict=True):
        assert torch.equal(a["exp_avg_sq"], b["exp_avg_sq"]) and int(a["step"]) == int(b["step"])

    # a crash mid-write leaves a temporary directory: never taken for a checkpoint, then pruned
    (root / ".tmp-step-crashed").mkdir()
    assert latest_checkpoint(root) == path
    state.step = 4
    save_checkpoint(root, policy, opt, state, ONE, keep=2)
    assert not list(root.glob(".tmp-step-*"))
    # LATEST naming something incomplete is an error, not a silent fresh start
    (root / "LATEST").write_text("step-00000099")
    with pytest.raises(CheckpointError, match="not a complete checkpoint"):
        latest_checkpoint(root)
