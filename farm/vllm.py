"""The `vllm serve` processes of `farm up --inference vllm`, rendered from one typed config.

`VllmServe` holds what one server must be started with for the farm, and `argv()` /
`env()` render it; vLLM 0.33's own argument parser is the test of the result
(tests/farm/test_vllm_serve.py). Every server gets:

- ``--served-model-name`` (the name requests may carry) and ``--logprobs-mode
  processed_logprobs``: each token's logprob from the distribution it was sampled from,
  which the learner recomputes (docs/inference.md, "Running vLLM");
- ``--generation-config vllm``: vLLM's neutral sampling defaults rather than the model's
  generation_config.json, which would change the distribution of a request that leaves
  a field out (the workers send every field; other clients might not);
- ``--weight-transfer-config '{"backend": "nccl"}'`` when the learner pushes over NCCL,
  which it does to servers on its own node (file pushes need no flag);
- for a LoRA run ``--enable-lora --max-lora-rank R --max-loras N`` and, in the
  environment, ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1`` (the adapter load routes);
- ``--tensor-parallel-size``, ``--max-model-len`` when given, then the user's ``--vllm-arg``s;
- ``VLLM_SERVER_DEV_MODE=1`` (the RL routes the weight push uses) and its GPUs as
  ``CUDA_VISIBLE_DEVICES``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from farm.gpus import GpuSettings

# Adapters a LoRA run keeps loaded per server: the current one and the one or two before it,
# which workers whose cached policy is a version behind still ask for (docs/deploy.md).
LORA_SLOTS = 3


@dataclass(frozen=True)
class VllmServe:
    """One `vllm serve` of the farm."""

    model: Path  # Hugging Face directory (the learner's --model)
    served_model_name: str
    host: str
    port: int
    cuda_devices: str  # CUDA_VISIBLE_DEVICES, one device per tensor-parallel rank
    tensor_parallel_size: int = 1
    nccl_weight_transfer: bool = False  # the learner pushes over vLLM's NCCL routes
    max_lora_rank: int | None = None  # a LoRA run: the largest adapter rank served
    max_loras: int = LORA_SLOTS
    max_model_len: int | None = None
    extra_args: tuple[str, ...] = ()

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def argv(self, binary: str = "vllm") -> tuple[str, ...]:
        args = [binary, "serve", str(self.model), "--host", self.host, "--port", str(self.port)]
        args += ["--served-model-name", self.served_model_name]
        args += ["--logprobs-mode", "processed_logprobs", "--generation-config", "vllm"]
        args += ["--tensor-parallel-size", str(self.tensor_parallel_size)]
        if self.nccl_weight_transfer:
            args += ["--weight-transfer-config", json.dumps({"backend": "nccl"})]
        if self.max_lora_rank is not None:
            args += ["--enable-lora", "--max-lora-rank", str(self.max_lora_rank)]
            args += ["--max-loras", str(self.max_loras)]
        if self.max_model_len is not None:
            args += ["--max-model-len", str(self.max_model_len)]
        return (*args, *self.extra_args)

    def env(self) -> dict[str, str]:
        env = {"CUDA_VISIBLE_DEVICES": self.cuda_devices, "VLLM_SERVER_DEV_MODE": "1"}
        if self.max_lora_rank is not None:
            env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "1"
        return env


def servers(
    gpus: GpuSettings, model: Path, ports: list[int], devices: list[str], nccl: bool
) -> list[VllmServe]:
    """One `VllmServe` per tensor-parallel group of `gpus.inference_gpus`, on `ports`, with
    `devices` (each group's CUDA_VISIBLE_DEVICES)."""
    return [
        VllmServe(
            model=model,
            served_model_name=gpus.served_model_name,
            host="127.0.0.1",
            port=port,
            cuda_devices=device,
            tensor_parallel_size=gpus.tensor_parallel_size,
            nccl_weight_transfer=nccl,
            max_lora_rank=gpus.max_lora_rank if gpus.lora_rank else None,
            max_model_len=gpus.max_model_len,
            extra_args=tuple(gpus.vllm_args),
        )
        for port, device in zip(ports, devices, strict=True)
    ]
