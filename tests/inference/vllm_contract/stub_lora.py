"""vLLM 0.33's worker-side LoRA manager on CPU, for the stub engine (runs in the stub process).

`lora_worker()` is the `LRUCacheWorkerLoRAManager` a vLLM GPU worker builds
(`LoRAModelRunnerMixin.load_lora_model`), over vLLM's `LRUCacheLoRAModelManager`: everything a
load or a step runs is vLLM's code (`add_adapter`, `_load_adapter` reading the safetensors
through `LoRAModel.from_local_checkpoint`, the CPU-cache and slot LRUs, `_apply_adapters`).
What is not built is the model side, which needs a GPU model with vLLM's LoRA layers: the
manager has no LoRA layer modules, so activating an adapter fills a slot with nothing, and the
tensors a request would be computed with are read from the registered `LoRAModel` of its id.
Pinned memory is off, as on vLLM's CPU platform (this machine has no accelerator to pin for).
"""

from __future__ import annotations

import torch
import vllm.lora.lora_model as lora_model_module
import vllm.lora.model_manager as model_manager_module
from vllm.config.lora import LoRAConfig
from vllm.lora.lora_model import LoRAModel
from vllm.lora.model_manager import AdapterLRUCache, LRUCacheLoRAModelManager
from vllm.lora.worker_manager import LRUCacheWorkerLoRAManager

from tests.inference.lora_helpers import tensors_digest

lora_model_module.PIN_MEMORY = False
model_manager_module.PIN_MEMORY = False

# the tiny model's projections (tests.inference.lora_helpers targets some of them)
MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def lora_worker(config: LoRAConfig) -> LRUCacheWorkerLoRAManager:
    """A worker's LoRA manager with `config`'s limits (max_loras GPU slots, max_cpu_loras)."""
    manager = object.__new__(LRUCacheLoRAModelManager)
    manager.model = torch.nn.Module()
    manager.lora_config = config
    manager.supported_lora_modules = list(MODULES)
    manager.packed_modules_mapping = {}
    manager.packed_modules = {}
    manager.modules = {}
    manager.moe_ep_load_spec = None
    manager.is_pooling_model = False
    manager._enable_mixed_moe_lora_format = False
    manager._classification_head = None
    manager._registered_adapters = AdapterLRUCache(manager.capacity, manager.deactivate_adapter)
    manager._active_adapters = AdapterLRUCache(manager.lora_slots, manager._deactivate_adapter)
    manager.lora_index_to_id = [None] * manager.lora_slots
    worker = object.__new__(LRUCacheWorkerLoRAManager)
    worker._lora_model_cls = LoRAModel
    worker.embedding_modules = {}
    worker._cached_dummy_lora = False
    worker.lora_config = config
    worker.vocab_size = 256
    worker.max_position_embeddings = 4096
    worker._adapter_manager = manager
    return worker


def served_digest(worker: LRUCacheWorkerLoRAManager, lora_int_id: int) -> str:
    """The digest of the tensors the worker holds for `lora_int_id` ("" if none)."""
    model = worker._adapter_manager.get_adapter(lora_int_id)
    if model is None:
        return ""
    pairs = {name: (w.lora_a, w.lora_b * w.scaling) for name, w in model.loras.items()}
    return tensors_digest(pairs)
