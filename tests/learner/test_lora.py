"""LoRA in the learner: only the adapter trains, checkpoints resume it exactly, exports load in
peft and transformers, the KL reference is the base, and bad LoRA settings are clear errors."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from learner.checkpoint import ADAPTER_DIR, LearnerState, load_training_state, save_checkpoint
from learner.config import LearnerConfig, WeightTransfer
from learner.core import build_core
from learner.distributed import DistContext
from learner.errors import ConfigError
from learner.export import export_hf_dir
from learner.lora import LoraSettings, apply_lora, merged_weights, save_adapter
from learner.reference import AdapterOffReference
from learner.scoring import sequence_logprobs
from learner.trainer import Trainer
from learner.weights import WeightPusher
from tests.learner.split import SCALE, batch_samples, make_trainer

ONE = DistContext()
LORA = LoraSettings(rank=4, alpha=8.0)


def lora_trainer(
    model_dir: Path, settings: LoraSettings = LORA, dist: DistContext = ONE
) -> Trainer:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)  # the adapters' initial A, the same on every rank
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    apply_lora(model, settings, model_dir)
    optim = make_trainer(model_dir, ONE).cfg  # the split tests' optimizer settings
    return Trainer(model, optim, torch.device("cpu"), dist, scale=SCALE)


def step(trainer: Trainer, name: str) -> float:
    samples = batch_samples(name)
    tokens = sum(int(s.loss_mask.sum()) for s in samples)
    return trainer.step(samples, tokens, len(samples)).loss


def optimizer_bytes(trainer: Trainer) -> tuple[int, int]:
    tensors = [t for s in trainer.optimizer.state.values() for t in s.values() if t.dim() > 0]
    return len(tensors), sum(t.numel() * t.element_size() for t in tensors)


def test_only_the_adapter_gets_gradients_and_optimizer_state(tiny_model_dir: Path) -> None:
    trainer = lora_trainer(tiny_model_dir)
    base = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if ".lora_" not in n}
    adapter = {n: p for n, p in trainer.model.named_parameters() if ".lora_" in n}
    # 2 layers x q,k,v,o x (A, B)
    assert len(adapter) == 16 and all(p.requires_grad for p in adapter.values())
    step(trainer, "first")
    step(trainer, "second")  # B starts at zero: the second step moves A too
    for name, p in trainer.model.named_parameters():
        if ".lora_" in name:
            assert p.grad is not None, name
        else:  # frozen: no gradient (the tied embedding built none either), unchanged
            assert p.grad is None, name
            assert torch.equal(p, base[name]), name
    assert all(bool(p.abs().sum() > 0) for n, p in adapter.items() if "lora_B" in n)
    count, nbytes = optimizer_bytes(trainer)
    adapter_bytes = sum(p.numel() * p.element_size() for p in adapter.values())
    assert count == 2 * len(adapter) and nbytes == 2 * adapter_bytes  # exp_avg, exp_avg_sq
    full = make_trainer(tiny_model_dir, ONE)
    step(full, "first")
    assert optimizer_bytes(full)[1] > 20 * nbytes


def test_checkpoint_keeps_the_adapter_and_resumes_exactly(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    trainer = lora_trainer(tiny_model_dir)
    step(trainer, "first")
    path = save_checkpoint(tmp_path, trainer.policy, trainer.optimizer, LearnerState(step=1), ONE)
    assert (path / ADAPTER_DIR / "adapter_model.safetensors").is_file()
    assert not (path / "model.safetensors").exists()  # the base is --model's
    saved = dcp.FileSystemReader(path / "dcp").read_metadata().state_dict_metadata
    params = {f"model.lm.{n}" for n, _ in trainer.model.named_parameters()}
    assert {k for k in saved if k in params} == {k for k in params if ".lora_" in k}
    continued = step(trainer, "second")
    resumed = lora_trainer(tiny_model_dir)
    load_training_state(path, resumed.policy, resumed.optimizer)
    assert step(resumed, "second") == continued
    for (name, a), b in zip(
        trainer.model.named_parameters(), resumed.model.parameters(), strict=True
    ):
        assert torch.equal(a, b), name


# peft 0.21 reads transformers' deprecated alias while loading an adapter
@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")
def test_exports_load_as_a_peft_adapter_and_as_merged_weights(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    import peft
    from transformers import AutoModelForCausalLM

    trainer = lora_trainer(tiny_model_dir)
    step(trainer, "first")
    step(trainer, "second")
    ids = torch.tensor([[1, 5, 9, 42, 7, 3]])
    want = trainer.model(input_ids=ids).logits
    save_adapter(trainer.model, tmp_path / "adapter", writer=True)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    loaded = peft.PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    torch.testing.assert_close(loaded(input_ids=ids).logits, want)
    export_hf_dir(
        trainer.model, tmp_path / "merged", True, tiny_model_dir, merged_weights(trainer.model)
    )
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32)
    torch.testing.assert_close(merged(input_ids=ids).logits, want, atol=1e-5, rtol=1e-5)


def test_reference_is_the_base_with_adapters_off(tiny_model_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    trainer = lora_trainer(tiny_model_dir)
    step(trainer, "first")
    step(trainer, "second")
    samples = batch_samples("third")
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    want = sequence_logprobs(base, samples, trainer.scoring)
    got = AdapterOffReference(trainer.model).logprobs(samples, trainer.scoring)
    policy = sequence_logprobs(trainer.model, samples, trainer.scoring)
    for g, w, p in zip(got, want, policy, strict=True):
        assert (g == w).all()
        assert not (p == w).all()  # the adapter is back on afterwards


def config(model: Path, **kw: object) -> LearnerConfig:
    return LearnerConfig(model=model, **kw)  # type: ignore[arg-type]


def test_bad_lora_settings_are_clear_errors(tiny_model_dir: Path) -> None:
    with pytest.raises(ValueError, match="lora_target_modules"):
        LoraSettings(rank=4, target_modules=[])
    with pytest.raises(ValueError, match="rank"):
        LoraSettings(rank=-1)
    bad = config(tiny_model_dir, lora=LoraSettings(rank=4, target_modules=["no_such_proj"]))
    with pytest.raises(ConfigError, match="lora-target-modules"):
        build_core(bad, ONE, torch.device("cpu"))
    nccl = config(
        tiny_model_dir,
        lora=LORA,
        weight_transfer=WeightTransfer.NCCL,
        inference_urls=["http://127.0.0.1:1"],
    )
    with pytest.raises(ConfigError, match="--weight-transfer file"):
        WeightPusher(nccl)


def test_lora_flags_resolve(tiny_model_dir: Path) -> None:
    from learner.cli import load_config

    cfg = load_config(
        [
            "--model",
            str(tiny_model_dir),
            "--lora-rank",
            "8",
            "--lora-target-modules",
            "q_proj,v_proj",
            "--lora-export",
            "merged",
        ]
    )
    assert cfg.lora.rank == 8 and cfg.lora.target_modules == ["q_proj", "v_proj"]
    assert cfg.lora.export == "merged" and cfg.lora.alpha == 32.0
    assert not LearnerConfig(model=tiny_model_dir).lora.enabled


# rank 16, alpha 32, lr 1e-2 on the tiny model built with initializer_range 0.1 (with the
# LM head frozen, the usual 0.02 caps a logit's move at ~1.3 and LoRA stays at chance): the
# 10-step mean reached 0.6 at steps 30, 30 and 42 on seeds 0, 1, 2 (0.88-0.90 by step 75)
LORA_TOY = {
    "learning_rate": 1e-2,
    "lr_warmup_steps": 10,
    "micro_batch_size": 64,
    "lora": {"rank": 16, "alpha": 32.0},
}


def test_a_lora_run_learns_the_toy(tmp_path: Path) -> None:
    from inference.tiny import build_tiny_model
    from tests.learner.inprocess import train, window_mean

    model = build_tiny_model(tmp_path / "model", seed=0, initializer_range=0.1)
    run = train(model, "toy", steps=50, seed=0, groups=16, flags=LORA_TOY)
    windows = window_mean(run.rewards)
    assert windows[0] < 0.2 and max(windows) >= 0.6, f"no learning: {run.rewards}"
    worst = max(s.behaviour_log_ratio_std for s in run.stats)
    assert worst < 1e-3, worst  # on policy: mu = pi


def test_the_kl_reference_of_a_lora_run_is_the_policy_itself(tiny_model_dir: Path) -> None:
    cfg = LearnerConfig.load(
        {"model": tiny_model_dir, "kl_coef": 0.1, "lora": {"rank": 4}}, environ={}
    )
    core = build_core(cfg, ONE, torch.device("cpu"))
    reference = core.trainer.reference
    assert isinstance(reference, AdapterOffReference) and reference.model is core.trainer.model


def test_lora_dropout_acts_in_the_gradient_pass_only(tiny_model_dir: Path) -> None:
    trainer = lora_trainer(tiny_model_dir, LoraSettings(rank=4, alpha=8.0, dropout=0.5))
    step(trainer, "first")  # B moves off zero, so the adapter's input dropout shows
    samples = batch_samples("second")
    with torch.no_grad():  # scoring: exact, the same every time
        _, a, _, _ = trainer.forward(samples)
        _, b, _, _ = trainer.forward(samples)
    assert torch.equal(a, b)
    _, c, _, _ = trainer.forward(samples)  # a gradient pass: dropout on
    assert c.requires_grad and not torch.allclose(c.detach(), a)


@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")
def test_the_push_export_follows_lora_export(tiny_model_dir: Path, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    ids = torch.tensor([[1, 5, 9, 42, 7, 3]])
    for export in ("adapter", "merged"):
        cfg = LearnerConfig.load(
            {"model": tiny_model_dir, "lora": {"rank": 4, "export": export}}, environ={}
        )
        core = build_core(cfg, ONE, torch.device("cpu"))
        for p in core.trainer.model.parameters():  # a trained-looking adapter (B is 0 at first)
            if p.requires_grad:
                torch.nn.init.normal_(p.data, std=0.1)
        core.export(tmp_path / export)
        written = sorted(f.name for f in (tmp_path / export).iterdir())
        want = core.trainer.model(input_ids=ids).logits
        if export == "adapter":
            assert written == ["adapter_config.json", "adapter_model.safetensors"]
            continue
        assert "model.safetensors" in written and "config.json" in written
        merged = AutoModelForCausalLM.from_pretrained(tmp_path / export, dtype=torch.float32)
        torch.testing.assert_close(merged(input_ids=ids).logits, want, atol=1e-5, rtol=1e-5)
