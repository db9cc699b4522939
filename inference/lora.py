"""LoRA adapters on the CPU policy server: read a peft adapter directory, apply it on the fly.

An adapter is read from a peft `save_pretrained` directory (`adapter_config.json` and
`adapter_model.safetensors`; the pickle-based `adapter_model.bin` is refused). The config is
checked as vLLM 0.33's `PEFTHelper.validate_legal` checks it, with its messages: rank above
`max_lora_rank`, DoRA, LoRA bias, `bias != "none"`, `modules_to_save`, and base-modifying
inits are refused. Scaling is `lora_alpha / r` (`lora_alpha / sqrt(r)` with rsLoRA); per-module
`rank_pattern`/`alpha_pattern` apply by peft's suffix rule.

Why on the fly rather than merged: the base weights are never touched, so several adapters (of
several runs) share one model with no copy per adapter, a base-weight reload keeps every adapter
valid on top of the new base (as in vLLM), and loading or unloading is a dictionary update.
`LoraHooks` puts one forward hook on each targeted `nn.Linear`; the engine sets `active` to the
adapter of the sequences in a forward pass (it groups sequences by adapter), and the hook adds
`lora_B(lora_A(x)) * scaling` to the layer's output, the same operations in the same order as
peft's `LoraLayer.forward`, so tokens and logprobs match a peft model exactly in float32.
"""

from __future__ import annotations

import itertools
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.nn import functional as F

from inference.errors import EngineError

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_PREFIX = "base_model.model."
_SUPPORTED_INITS = ("gaussian", "eva", "orthogonal", "mica", "lora_ga")
_load_ids = itertools.count(1)


class AdapterNotFound(EngineError):
    """No adapter directory at the path: vLLM's LoRAAdapterNotFoundError (HTTP 404)."""

    def __init__(self, name: str, path: str) -> None:
        super().__init__(f"Loading lora {name} failed: No adapter found for {path}", status=404)


@dataclass(frozen=True)
class LoraModule:
    """One adapted linear layer: `out += (x @ a.T) @ b.T * scaling`."""

    a: torch.Tensor  # lora_A.weight, [r, in_features]
    b: torch.Tensor  # lora_B.weight, [out_features, r]
    scaling: float


@dataclass(frozen=True, eq=False)
class LoraAdapter:
    """A loaded adapter; identity (not value) equality, so each load is its own adapter."""

    name: str  # the served name (the `model` of requests)
    path: str  # where it was loaded from (reported as `root` by /v1/models)
    rank: int  # largest rank over its modules
    modules: dict[str, LoraModule]  # model module name -> its low-rank update
    load_id: int = field(default_factory=lambda: next(_load_ids))  # vLLM's lora_int_id

    @property
    def cache_salt(self) -> bytes:
        """Prefix-cache key salt: KV computed under this load is never reused by another."""
        return f"lora:{self.load_id}".encode()


def read_adapter(name: str, path: str, model: torch.nn.Module, max_rank: int) -> LoraAdapter:
    """Read and check the peft adapter at `path` against `model`; EngineError says what is wrong."""
    root = Path(path)
    if not (root / CONFIG_FILE).is_file():
        raise AdapterNotFound(name, path)
    try:
        config = json.loads((root / CONFIG_FILE).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise EngineError(f"{CONFIG_FILE} of adapter '{name}' is not valid JSON: {exc}") from None
    if not isinstance(config, dict):
        raise EngineError(f"{CONFIG_FILE} of adapter '{name}' must be a JSON object")
    _check_config(config, max_rank)
    tensors = _read_tensors(name, root)
    modules = _modules(name, config, tensors, model)
    rank = max(m.a.shape[0] for m in modules.values())
    return LoraAdapter(name=name, path=path, rank=rank, modules=modules)


def _check_config(config: dict[str, Any], max_rank: int) -> None:
    """vLLM 0.33's PEFTHelper checks (same messages), plus what the CPU server cannot apply."""
    missing = {"r", "lora_alpha", "target_modules"} - set(config)
    if missing:
        raise EngineError(f"Missing required configuration fields: {missing}")
    if config.get("peft_type", "LORA") != "LORA":
        raise EngineError(f"peft_type {config['peft_type']!r} is not a LoRA adapter")
    ranks = [config["r"], *(config.get("rank_pattern") or {}).values()]
    if not all(isinstance(r, int) and not isinstance(r, bool) and r > 0 for r in ranks):
        raise EngineError(f"LoRA rank `r` must be a positive integer, got {config['r']}.")
    if not isinstance(config["lora_alpha"], int | float) or isinstance(config["lora_alpha"], bool):
        raise EngineError(f"lora_alpha must be a number, got {config['lora_alpha']!r}")
    errors = []
    modules_to_save = config.get("modules_to_save") or []
    if modules_to_save:
        errors.append(f"modules_to_save is not supported: {modules_to_save}")
    if config.get("use_dora"):
        errors.append("vLLM does not yet support DoRA.")
    if config.get("lora_bias"):
        errors.append("vLLM does not support LoRA bias (lora_bias).")
    init = config.get("init_lora_weights", True)
    if isinstance(init, str) and init.lower() not in _SUPPORTED_INITS:
        errors.append(f"vLLM does not support init_lora_weights={init!r}.")
    for key in ("alora_invocation_tokens", "layer_replication", "use_bdlora", "use_qalora"):
        if config.get(key):
            errors.append(f"vLLM does not support {key}.")
    if config.get("fan_in_fan_out"):
        errors.append("fan_in_fan_out (Conv1D layers) is not supported by the CPU server.")
    if max(ranks) > max_rank:
        errors.append(f"LoRA rank {max(ranks)} is greater than max_lora_rank {max_rank}.")
    if config.get("bias", "none") != "none":
        errors.append("Adapter bias is not supported.")
    if errors:
        raise EngineError(" ".join(errors))


def _read_tensors(name: str, root: Path) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    weights = root / WEIGHTS_FILE
    if not weights.is_file():
        raise EngineError(
            f"adapter '{name}' has no {WEIGHTS_FILE} in {root} (.bin adapters are not read)"
        )
    try:
        return load_file(weights)
    except (SafetensorError, OSError) as exc:
        raise EngineError(f"{WEIGHTS_FILE} of adapter '{name}' is unreadable: {exc}") from None


def _pattern(patterns: dict[str, Any], module: str) -> Any:
    """peft's `get_pattern_key`: the first key that is a dotted suffix of the module name."""
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return None


def _modules(
    name: str, config: dict[str, Any], tensors: dict[str, torch.Tensor], model: torch.nn.Module
) -> dict[str, LoraModule]:
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = re.fullmatch(r"(.+)\.lora_([AB])\.weight", key.removeprefix(_PREFIX))
        if match is None:
            raise EngineError(f"adapter '{name}': unexpected tensor {key!r} (only lora_A/lora_B)")
        pairs.setdefault(match.group(1), {})[match.group(2)] = tensor
    if not pairs:
        raise EngineError(f"adapter '{name}' has no LoRA weights")
    layers = dict(model.named_modules())
    modules = {}
    for module, ab in sorted(pairs.items()):
        layer = layers.get(module)
        if not isinstance(layer, torch.nn.Linear):
            raise EngineError(f"adapter '{name}' targets {module!r}, not a linear layer here")
        if set(ab) != {"A", "B"}:
            raise EngineError(f"adapter '{name}': {module!r} needs both lora_A and lora_B")
        a, b = ab["A"], ab["B"]
        r = a.shape[0]
        if a.shape != (r, layer.in_features) or b.shape != (layer.out_features, r):
            raise EngineError(
                f"adapter '{name}': {module!r} has lora_A {tuple(a.shape)} and lora_B "
                f"{tuple(b.shape)}, the layer is {layer.in_features} -> {layer.out_features}"
            )
        rank = _pattern(config.get("rank_pattern") or {}, module) or config["r"]
        alpha = _pattern(config.get("alpha_pattern") or {}, module) or config["lora_alpha"]
        if r != rank:
            raise EngineError(f"adapter '{name}': {module!r} has rank {r}, its config says {rank}")
        scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
        dtype = layer.weight.dtype
        modules[module] = LoraModule(a.to(dtype), b.to(dtype), scaling)
    return modules


class AdapterTable:
    """The adapters a server has loaded, by name (`--enable-lora`, `--max-lora-rank`).

    Unlike vLLM there is no CPU-cache eviction (`--max-cpu-loras`): every loaded adapter stays
    in memory until unloaded; adapters are small next to the model.
    """

    def __init__(self, model: torch.nn.Module, max_rank: int, max_loras: int) -> None:
        self.model = model
        self.max_rank = max_rank
        self.max_loras = max_loras  # most distinct adapters in one batch (vLLM's meaning)
        self.hooks = LoraHooks(model)
        self.loaded: dict[str, LoraAdapter] = {}

    def read(self, name: str, path: str) -> LoraAdapter:
        """Read and check an adapter (no state changes; run it off the event loop)."""
        return read_adapter(name, path, self.model, self.max_rank)

    def add(self, adapter: LoraAdapter) -> None:
        """Serve `adapter` under its name (replacing an in-place reload); between steps."""
        self.hooks.install(adapter)
        self.loaded[adapter.name] = adapter


class LoraHooks:
    """Forward hooks on a model's linear layers that add the `active` adapter's update.

    Hooks are installed on a layer the first time an adapter targets it and stay (a hook with
    no active adapter, or an adapter that does not target its layer, returns None: no change).
    Only the engine's forward thread sets `active`, under the engine lock.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self._layers = dict(model.named_modules())
        self._hooked: set[str] = set()
        self.active: LoraAdapter | None = None

    def install(self, adapter: LoraAdapter) -> None:
        for module in adapter.modules:
            if module not in self._hooked:
                self._layers[module].register_forward_hook(self._hook(module))
                self._hooked.add(module)

    def _hook(self, module: str) -> Any:
        def add_update(layer: torch.nn.Module, args: tuple[Any, ...], out: torch.Tensor) -> Any:
            adapter = self.active
            lora = adapter.modules.get(module) if adapter is not None else None
            if lora is None:
                return None
            return out + F.linear(F.linear(args[0], lora.a), lora.b) * lora.scaling

        return add_update

    def using(self, adapter: LoraAdapter | None) -> _Active:
        return _Active(self, adapter)


class _Active:
    """`with hooks.using(adapter):` a forward pass under `adapter` (None: base weights)."""

    def __init__(self, hooks: LoraHooks, adapter: LoraAdapter | None) -> None:
        self.hooks, self.adapter = hooks, adapter

    def __enter__(self) -> None:
        self.hooks.active = self.adapter

    def __exit__(self, *exc: object) -> None:
        self.hooks.active = None
