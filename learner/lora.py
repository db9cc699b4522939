"""LoRA training through peft: the adapter's config, its injection, and what it writes.

With ``--lora-rank R > 0`` the learner injects peft LoRA layers into the Hugging Face model in
place (`apply_lora`: the model keeps its class, so `learner.policy.PolicyModel`, FSDP2 and the
chunked logprobs run as without LoRA) and freezes every other parameter: only the adapter's
``lora_A``/``lora_B`` get gradients and AdamW state. The LM head and the embeddings are frozen,
so the tied-embedding gradient path (`learner.tied`) is not taken.

What a version is written as (``--lora-export``):
- ``adapter``: a peft adapter directory (``adapter_config.json`` + ``adapter_model.safetensors``,
  `save_adapter`), which ``peft.PeftModel.from_pretrained(base, dir)`` and vLLM's
  ``/v1/load_lora_adapter`` load; the push serves it as ``<run>-v<N>-<digest>``
  (`learner.adapter_push`);
- ``merged``: full Hugging Face weights with ``W + scale * B @ A`` folded in (`merged_weights`),
  pushed through the file path, so a server without LoRA support serves it.

The frozen base is what ``--model`` holds: checkpoints keep only the trainable tensors
(`learner.checkpoint`), and the KL reference is the policy with its adapters switched off
(`learner.reference.AdapterOffReference`) instead of a second copy of the model.
"""

from __future__ import annotations

import contextlib
import enum
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import ConfigDict, Field, field_validator
from pydantic.dataclasses import dataclass

from launch.settings import CommaList

if TYPE_CHECKING:
    import torch


ADAPTER_WEIGHTS = "adapter_model.safetensors"
# Llama-style attention projections (Llama, Qwen2/3, Mistral, SmolLM2): peft's own default
# for these architectures is q,v only; k and o too cost little and learn more per rank
DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")


class LoraExport(enum.StrEnum):
    """What each LoRA version is written and pushed as."""

    ADAPTER = "adapter"  # a peft adapter directory, served as <run>-v<N>-<digest> (--enable-lora)
    MERGED = "merged"  # full weights with the adapter merged in, pushed as a file reload


@dataclass(frozen=True, config=ConfigDict(extra="forbid"))
class LoraSettings:
    """LoRA adapters (peft) instead of full fine-tuning (docs/learner.md)."""

    rank: int = Field(0, ge=0, le=1024, description="LoRA rank r (0: full fine-tuning)")
    alpha: float = Field(32.0, gt=0.0, description="LoRA alpha: the update is scaled alpha/r")
    target_modules: CommaList = Field(
        default_factory=lambda: list(DEFAULT_TARGETS),
        description="module name suffixes that get adapters (default: q,k,v,o projections)",
    )
    dropout: float = Field(
        0.0, ge=0.0, lt=1.0, description="dropout on the adapter's input (gradient passes only)"
    )
    export: LoraExport = Field(LoraExport.ADAPTER, description="adapter | merged (full weights)")
    adapter_keep_s: float = Field(
        600.0,
        ge=0.0,
        description="keep a pushed adapter's directory until no server has listed it for this "
        "long (vLLM re-reads an evicted adapter for requests still running under it)",
    )

    @field_validator("target_modules")
    @classmethod
    def _targets(cls, value: list[str]) -> list[str]:
        if not value:
            raise ValueError("lora_target_modules must name at least one module")
        return value

    @property
    def enabled(self) -> bool:
        return self.rank > 0


def apply_lora(lm: torch.nn.Module, settings: LoraSettings, base: Path) -> torch.nn.Module:
    """Inject `settings`' adapters into `lm` in place and freeze everything else.

    ValueError when no module of `lm` matches the target names."""
    import peft
    import torch

    config = peft.LoraConfig(
        r=settings.rank,
        lora_alpha=settings.alpha,
        target_modules=list(settings.target_modules),
        lora_dropout=settings.dropout,
        bias="none",
        base_model_name_or_path=str(base),
        task_type="CAUSAL_LM",
    )
    peft.inject_adapter_in_model(config, lm)
    for name, param in lm.named_parameters():
        param.requires_grad_(".lora_" in name)
    for module in lm.modules():
        if isinstance(module, peft.tuners.lora.LoraLayer):
            for drop in module.lora_dropout.values():
                if isinstance(drop, torch.nn.Dropout):
                    # the trainer runs in eval mode (exact logprobs); the adapter's dropout
                    # acts in the gradient pass only, never in a no-grad score
                    drop.register_forward_pre_hook(_train_under_grad)
    return lm


def _train_under_grad(module: torch.nn.Module, args: Any) -> None:
    import torch

    module.training = torch.is_grad_enabled()


def is_lora(lm: torch.nn.Module) -> bool:
    return bool(getattr(lm, "peft_config", None))


def _full(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor (gathered when FSDP sharded it: collective), detached, on the CPU."""
    from torch.distributed.tensor import DTensor

    whole = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
    return whole.detach().to("cpu").contiguous()


def _lora_layers(lm: torch.nn.Module) -> Iterator[tuple[str, Any]]:
    import peft

    for name, module in lm.named_modules():
        if isinstance(module, peft.tuners.lora.LoraLayer):
            yield name, module


def adapter_weights(lm: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The adapter's tensors under peft's saved names (collective under FSDP)."""
    import peft

    state = {name: _full(t) for name, t in lm.state_dict().items() if ".lora_" in name}
    # as PeftModel.save_pretrained names them: the PeftModel wraps the model we adapted
    saved = peft.get_peft_model_state_dict(lm, state_dict=state)
    return {f"base_model.model.{name}": t for name, t in saved.items()}


def save_adapter(lm: torch.nn.Module, out_dir: Path, writer: bool) -> int:
    """Write the peft adapter directory (on the writer rank; collective under FSDP).

    Returns the adapter's bytes (the extra memory the gather held)."""
    from safetensors.torch import save_file

    weights = adapter_weights(lm)
    if writer:
        out_dir.mkdir(parents=True, exist_ok=True)
        config = lm.peft_config["default"]  # type: ignore[index, union-attr]
        config.save_pretrained(str(out_dir))
        save_file(weights, str(out_dir / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    return sum(t.numel() * t.element_size() for t in weights.values())


def merged_weights(lm: torch.nn.Module) -> dict[str, torch.Tensor]:
    """`lm`'s weights under the base model's names, each adapted weight W + scale * B @ A.

    Adapted weights are gathered whole (collective under FSDP); the others stay as they are
    (sharded ones are streamed by `learner.export`). The live model is not touched: merging
    in place and back would not restore the base bit for bit."""
    merged: dict[str, torch.Tensor] = {}
    for name, module in _lora_layers(lm):
        adapter = module.active_adapters[0]
        weight = _full(module.base_layer.weight)
        a, b = _full(module.lora_A[adapter].weight), _full(module.lora_B[adapter].weight)
        delta = (b @ a) * module.scaling[adapter]
        merged[f"{name}.weight"] = weight + delta.to(weight.dtype)
    out: dict[str, torch.Tensor] = {}
    for name, tensor in lm.state_dict(keep_vars=True).items():
        if ".lora_" in name:
            continue
        plain = name.replace(".base_layer.", ".")
        out[plain] = merged.get(plain, tensor)
    return out


@contextlib.contextmanager
def adapters_off(lm: torch.nn.Module) -> Iterator[None]:
    """`lm` as the base model: every adapter layer bypassed (the adapter stays trainable)."""
    layers = [module for _, module in _lora_layers(lm)]
    for module in layers:
        module._disable_adapters = True
    try:
        yield
    finally:
        for module in layers:
            module._disable_adapters = False
