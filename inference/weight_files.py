"""Loading a weight version into the CPU engine's model from safetensors files, all or nothing."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from inference.errors import EngineError


def read_weights(path: Path) -> dict[str, torch.Tensor]:
    path = Path(path)
    if path.is_dir():
        files = sorted(path.glob("*.safetensors"))
    elif path.is_file():
        files = [path]
    else:
        raise EngineError(f"weights path {str(path)!r} does not exist")
    if not files:
        raise EngineError(f"no *.safetensors files in {str(path)!r}")
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        try:
            tensors.update(load_file(file))
        except (SafetensorError, OSError) as exc:
            raise EngineError(f"cannot read {file.name}: {exc}") from exc
    return tensors


def copy_weights(
    model: torch.nn.Module, tensors: dict[str, torch.Tensor], complete: bool = True
) -> None:
    """Validate every name and shape first, then copy, so a bad file changes nothing."""
    state = model.state_dict()
    unknown = sorted(set(tensors) - set(state))
    if unknown:
        raise EngineError(f"weights contain unknown tensors: {unknown[:5]}")
    for name, tensor in tensors.items():
        if tuple(tensor.shape) != tuple(state[name].shape):
            raise EngineError(
                f"shape of {name} is {tuple(tensor.shape)}, model has {tuple(state[name].shape)}"
            )
    by_storage: dict[int, list[str]] = {}
    for name, tensor in state.items():
        by_storage.setdefault(tensor.data_ptr(), []).append(name)
    missing = [names[0] for names in by_storage.values() if not any(n in tensors for n in names)]
    if missing and complete:
        raise EngineError(f"weights lack tensors: {sorted(missing)[:5]}")
    with torch.no_grad():
        for name, tensor in tensors.items():
            state[name].copy_(tensor)
