"""LoRA test material: peft adapters of the tiny model, and peft's own logprobs as the reference."""

from __future__ import annotations

import contextlib
import hashlib
import json
import shutil
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM


@contextlib.contextmanager
def quiet_peft() -> Iterator[None]:
    """peft 0.21 reads transformers' deprecated `is_gradient_checkpointing` (a FutureWarning,
    an error under the suite's filterwarnings); nothing else is silenced."""
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning
        )
        yield


def make_adapter(
    base: Path,
    out: Path,
    seed: int,
    *,
    r: int = 4,
    alpha: int = 8,
    targets: Sequence[str] = ("q_proj", "v_proj", "down_proj"),
    b_std: float = 0.5,
    **config: Any,
) -> Path:
    """A peft adapter of `base` as `save_pretrained` writes it, with lora_B drawn nonzero
    (peft starts it at zero, which would change nothing)."""
    from peft import LoraConfig, get_peft_model

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    with torch.random.fork_rng(devices=[]), quiet_peft():
        torch.manual_seed(seed)
        peft_model = get_peft_model(
            model, LoraConfig(r=r, lora_alpha=alpha, target_modules=list(targets), **config)
        )
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                torch.nn.init.normal_(param, std=b_std)
    peft_model.save_pretrained(out)
    return out


def edit_config(adapter: Path, **changes: Any) -> Path:
    """Rewrite fields of an adapter's adapter_config.json in place."""
    path = adapter / "adapter_config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))
    return adapter


def peft_logprobs(
    base: Path, adapter: Path | None, prompt: list[int], completion: list[int]
) -> torch.Tensor:
    """Teacher-forced logprobs (temperature 1) of `completion` under base + adapter, by peft."""
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    if adapter is not None:
        from peft import PeftModel

        with quiet_peft():
            model = PeftModel.from_pretrained(model, adapter)
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + completion])).logits[0].float()
    rows = logits[len(prompt) - 1 : len(prompt) - 1 + len(completion)]
    return torch.log_softmax(rows, -1).gather(1, torch.tensor(completion)[:, None])[:, 0]


def tensors_digest(pairs: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> str:
    """sha256 over each module's (lora_A, scaling x lora_B) as float32, in module-name order
    (vLLM folds the scaling into lora_B when it registers an adapter)."""
    sha = hashlib.sha256()
    for name in sorted(pairs):
        sha.update(name.encode())
        for tensor in pairs[name]:
            sha.update(tensor.detach().to(torch.float32).contiguous().numpy().tobytes())
    return sha.hexdigest()[:16]


def adapter_tensors_digest(adapter: Path) -> str:
    """`tensors_digest` of a peft adapter directory's weights, under vLLM's module names
    (scaling lora_alpha / r: no rsLoRA, no rank or alpha patterns)."""
    from safetensors.torch import load_file

    config = json.loads((adapter / "adapter_config.json").read_text())
    scaling = config["lora_alpha"] / config["r"]
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in load_file(adapter / "adapter_model.safetensors").items():
        module, _, part = key.removeprefix("base_model.model.").rpartition(".lora_")
        pairs.setdefault(module, {})[part.removesuffix(".weight")] = tensor
    return tensors_digest({m: (ab["A"], ab["B"] * scaling) for m, ab in pairs.items()})


class AdapterSource:
    """A learner `WeightSource` whose export writes a prepared adapter (as if just trained)."""

    def __init__(self, adapter: Path) -> None:
        self.adapter = adapter

    def export(self, out_dir: Path) -> int:
        shutil.copytree(self.adapter, out_dir)
        return 0

    def weight_stream(self) -> Any:
        raise AssertionError("a LoRA adapter is pushed by file")
