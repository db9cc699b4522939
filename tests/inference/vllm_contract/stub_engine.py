"""A stub engine client behind vLLM 0.33's real routers (runs inside the stub server process).

It stands in for vLLM's `AsyncLLM` only: everything between HTTP and it is vLLM's own code.
What it does follows 0.33's engine:

- pause (`pause_generation(mode, clear_cache)`): `abort` ends in-flight completions with finish
  reason `abort`; `wait` lets them finish; in both, new completions are refused with vLLM's
  `RetryableRequestError` (HTTP 503) until resume. `keep` freezes in-flight completions and
  queues new ones; with `clear_cache` the kept requests' cache is dropped at pause time
  (counted in `cache_resets`), as 0.33's `_finish_pause` does.
- the NCCL weight-transfer calls run vLLM's own `NCCLWeightTransferEngine.parse_init_info`,
  `init_transfer_engine`, `parse_update_info` and `receive_weights`, one engine per simulated
  worker (TP x PP x DP of them), with the worker's rank from vLLM's `_worker_group_rank`. Only
  the communicator differs: vLLM's PyNcclCommunicator is replaced by the project's gloo
  stand-in (`inference.nccl.GlooCommunicator`), because this machine has no NCCL.
- `collective_rpc("reload_weights", weights_path=...)` really reads the safetensors files.
- LoRA: `add_lora` is the worker's `add_adapter` of vLLM's own `LRUCacheWorkerLoRAManager`
  (`stub_lora`), and each decoding step of a completion under an adapter runs the manager's
  `_apply_adapters` for it, as the model runner does before every forward: an adapter evicted
  from the CPU cache is read again from its path. A failure there kills the engine, as an
  exception inside `execute_model` kills vLLM's engine core (`dead`; later completions and
  /health fail).

Every call is appended to `calls`, so tests can check the order a client used.
"""

from __future__ import annotations

import asyncio
import hashlib
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from vllm.config.lora import LoRAConfig
from vllm.distributed.weight_transfer import nccl_engine
from vllm.distributed.weight_transfer.nccl_common import _worker_group_rank
from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferEngine
from vllm.exceptions import RetryableRequestError
from vllm.v1.engine.exceptions import EngineDeadError

from inference.nccl import GlooCommunicator
from tests.inference.vllm_contract.stub_lora import lora_worker, served_digest


def _gloo_worker_group(init_info: Any, parallel_config: Any) -> GlooCommunicator:
    """nccl_common.worker_init_process_group with gloo in place of NCCL (same rank rule)."""
    rank = _worker_group_rank(init_info.rank_offset, parallel_config)
    return GlooCommunicator(
        init_info.master_address, init_info.master_port, rank, init_info.world_size, 60.0
    )


nccl_engine.worker_init_process_group = _gloo_worker_group
# vLLM's unpacked receive passes torch.cuda.current_stream(); CPU torch has no CUDA stream.
torch.cuda.current_stream = lambda *a, **k: None  # type: ignore[assignment]


class ReceivedModel:
    """The `model` a worker's engine loads into: keeps a digest of every tensor received."""

    def __init__(self) -> None:
        self.received: dict[str, str] = {}

    def load_weights(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        for name, tensor in weights:
            self.received[name] = digest(tensor)


def digest(tensor: torch.Tensor) -> str:
    data = tensor.detach().contiguous().view(torch.uint8).numpy().tobytes()
    return f"{tensor.dtype}:{list(tensor.shape)}:{hashlib.sha256(data).hexdigest()[:16]}"


def _worker_engine(dp: int, tp_pp: int, rank: int) -> NCCLWeightTransferEngine:
    engine = object.__new__(NCCLWeightTransferEngine)  # no VllmConfig/GPU to build it from
    engine.parallel_config = SimpleNamespace(data_parallel_index=dp, world_size=tp_pp, rank=rank)
    engine.device = torch.device("cpu")
    engine.model = ReceivedModel()
    engine.model_update_group = None
    engine._last_update_info = {}
    return engine


class StubEngine:
    """The EngineClient methods the mounted routers call."""

    def __init__(self, tp: int, pp: int, dp: int) -> None:
        self.vllm_config = SimpleNamespace(
            parallel_config=SimpleNamespace(world_size=tp * pp, world_size_across_dp=tp * pp * dp)
        )
        self.workers = [_worker_engine(d, tp * pp, r) for d in range(dp) for r in range(tp * pp)]
        self.calls: list[str] = []
        self.version = "default"
        self.pause_mode: str | None = None
        self.cache_resets = 0
        self.reloaded: dict[str, str] = {}
        self._running = asyncio.Event()
        self._running.set()
        self._abort = asyncio.Event()
        self.in_flight = 0
        self.idle = asyncio.Event()  # set while no completion is in flight
        self.idle.set()
        # what OpenAIServingModels reads of `vllm serve --enable-lora` (default max rank 16)
        self.model_config = SimpleNamespace(model="stub-model", max_model_len=4096)
        self.renderer = self.input_processor = None
        # max_cpu_loras defaults to max_loras: 2 adapters in the CPU cache, as in `vllm serve`
        self.lora_config = LoRAConfig(max_lora_rank=16, max_loras=2, lora_dtype=torch.float32)
        self.lora_worker = lora_worker(self.lora_config)
        self.loras: dict[int, str] = {}  # lora_int_id -> path of what add_lora loaded
        self.generated_with: list[dict[str, str]] = []  # per completion: adapter, tensor digest
        self.dead: str | None = None  # why the engine core died (None: alive)

    # -- LoRA -------------------------------------------------------------------------------
    async def add_lora(self, lora_request: Any) -> bool:
        """The worker's load (`Worker.add_lora` -> `LRUCacheWorkerLoRAManager.add_adapter`):
        vLLM's PEFTHelper checks, then the tensors read into the CPU cache; a missing directory
        is LoRAAdapterNotFoundError (the router's 404)."""
        self.calls.append("add_lora")
        loaded = self.lora_worker.add_adapter(lora_request)
        self.loras[lora_request.lora_int_id] = lora_request.lora_path
        return loaded

    def apply_lora(self, lora_request: Any) -> None:
        """One step's `set_active_adapters` for a request under `lora_request`; a failure
        (the adapter's directory gone when it must be read again) kills the engine."""
        if self.dead is not None:
            raise EngineDeadError()
        try:
            self.lora_worker.set_active_adapters({lora_request}, None)
        except Exception as exc:
            self.dead = f"{type(exc).__name__}: {exc}"
            raise EngineDeadError() from exc

    def record_generation(self, lora_request: Any) -> None:
        digest = served_digest(self.lora_worker, lora_request.lora_int_id)
        self.generated_with.append({"model": lora_request.lora_name, "tensors": digest})

    # -- generation -------------------------------------------------------------------------
    async def admit(self) -> None:
        """Called before a completion starts: 503 in abort/wait pause, queued in keep."""
        if self.pause_mode in ("abort", "wait"):
            raise RetryableRequestError("Generation is paused. Please retry after it resumes.")
        await self._running.wait()

    def started(self) -> None:
        self.in_flight += 1
        self.idle.clear()

    def finished(self) -> None:
        self.in_flight -= 1
        if not self.in_flight:
            self.idle.set()

    async def step(self) -> bool:
        """One decoding step of an in-flight completion; False once aborted."""
        await asyncio.sleep(0.01)
        if self._abort.is_set():
            return False
        await self._running.wait()
        return True

    async def check_health(self) -> None:
        if self.dead is not None:
            raise EngineDeadError()

    # -- pause ------------------------------------------------------------------------------
    async def pause_generation(self, *, mode: str = "abort", clear_cache: bool = True) -> None:
        self.calls.append(f"pause:{mode}")
        self.pause_mode = mode
        if mode == "abort":
            self._abort.set()
        if mode == "keep":
            self._running.clear()
        if mode == "wait":
            await self.idle.wait()
        if clear_cache:
            self.cache_resets += 1

    async def resume_generation(self) -> None:
        self.calls.append("resume")
        self.pause_mode = None
        self._abort.clear()
        self._running.set()

    async def is_paused(self) -> bool:
        return self.pause_mode is not None

    # -- weight versions and caches ---------------------------------------------------------
    async def update_weight_version(self, new_version: str) -> None:
        self.calls.append(f"update_weight_version:{new_version}")
        self.version = new_version

    async def get_weight_version(self) -> str:
        return self.version

    async def reset_prefix_cache(
        self, reset_running: bool = False, reset_ext: bool = False
    ) -> bool:
        self.calls.append("reset_prefix_cache")
        return True

    async def collective_rpc(  # vLLM's router passes these keywords
        self,
        method: str,
        timeout: float | None = None,  # noqa: ASYNC109
        args: tuple = (),
        kwargs: Any = None,
    ) -> list[Any]:
        self.calls.append(f"collective_rpc:{method}")
        if method == "reload_weights":
            from safetensors.torch import load_file

            path = Path((kwargs or {})["weights_path"])
            files = sorted(path.glob("*.safetensors")) if path.is_dir() else [path]
            if not files:
                raise ValueError(f"no safetensors files under {path}")
            for file in files:
                self.reloaded |= {k: digest(v) for k, v in load_file(file).items()}
            return [None for _ in self.workers]
        if method == "received_weights":  # the test's window on what each worker got
            return [dict(w.model.received) for w in self.workers]
        raise ValueError(f"the stub engine has no method {method!r}")

    # -- NCCL weight transfer (vLLM's engine code per worker) -------------------------------
    async def init_weight_transfer_engine(self, request: Any) -> None:
        self.calls.append("init_weight_transfer_engine")
        infos = [w.parse_init_info(dict(request.init_info)) for w in self.workers]
        await asyncio.gather(
            *(
                asyncio.to_thread(w.init_transfer_engine, info)
                for w, info in zip(self.workers, infos, strict=True)
            )
        )

    async def start_weight_update(self) -> None:
        self.calls.append("start_weight_update")

    async def update_weights(self, request: Any) -> None:
        self.calls.append("update_weights")
        infos = [w.parse_update_info(dict(request.update_info)) for w in self.workers]
        await asyncio.gather(
            *(
                asyncio.to_thread(w.receive_weights, info)
                for w, info in zip(self.workers, infos, strict=True)
            )
        )

    async def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.calls.append(f"finish_weight_update:{weight_version}")
        if weight_version is not None:
            self.version = weight_version
