"""GPUs on the farm's node: the `GpuSettings` section of `farm up`, and which GPU runs what.

`farm up --inference vllm --inference-gpus 0-3 [--tensor-parallel-size 2] --learner-gpus 4-7`
gives every vLLM server `tensor_parallel_size` GPUs of `inference_gpus` (one server per
group, in order) and runs the learner under torchrun with one rank per `learner_gpus`
entry. GPU numbers are as the farm itself sees them: where the farm runs with
``CUDA_VISIBLE_DEVICES`` set, number i is the i-th device of that list, and each child
gets the devices it was given, by the same names, in its own ``CUDA_VISIBLE_DEVICES``.

`--learner-device cpu` keeps the ranks (one per entry of `learner_gpus`) but runs them on
the CPU with gloo: the same launch as on GPUs, for machines without one (tests, CI).
This module imports neither torch nor vLLM.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, ConfigDict, Field, model_validator
from pydantic.dataclasses import dataclass
from pydantic_settings import NoDecode

from farm.errors import ConfigError, StartupError

COMPONENT = ConfigDict(extra="forbid")
# vLLM 0.33's accepted --max-lora-rank values (vllm/config/lora.py, MaxLoRARanks)
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def parse_gpus(value: Any) -> Any:
    """ "0-3,6" -> [0, 1, 2, 3, 6]; a list (repeated flag, TOML array) item by item."""
    if isinstance(value, int):
        return [value]
    if isinstance(value, list | tuple):
        return [gpu for item in value for gpu in parse_gpus(item)]
    if not isinstance(value, str):
        return value
    out: list[int] = []
    for part in (p.strip() for p in value.split(",")):
        if not part:
            continue
        first, dash, last = part.partition("-")
        if not (first.isdigit() and (not dash or last.isdigit())):
            raise ValueError(f"{part!r} is not a GPU number or a range such as 0-3")
        if dash and int(last) < int(first):
            raise ValueError(f"empty GPU range {part!r}")
        out += range(int(first), int(last if dash else first) + 1)
    return out


# GPU numbers given as "0-3", "0,1,4-5" (flags, FARM_* variables) or a TOML array
GpuList = Annotated[list[int], NoDecode, BeforeValidator(parse_gpus)]


@dataclass(frozen=True, config=COMPONENT)
class GpuSettings:
    """Inference servers and learner ranks on this node's GPUs (docs/deploy.md)."""

    inference: Literal["cpu", "vllm"] = Field(
        "cpu", description="cpu: the CPU policy server; vllm: `vllm serve` on inference_gpus"
    )
    inference_gpus: GpuList = Field(
        default_factory=list, description="GPUs of the vLLM servers, e.g. 0-3"
    )
    tensor_parallel_size: int = Field(1, ge=1, le=64, description="GPUs per vLLM server")
    learner_gpus: GpuList = Field(
        default_factory=list,
        description="learner ranks under torchrun, one per GPU, e.g. 4-7 (empty: one process)",
    )
    learner_device: Literal["auto", "cuda", "cpu"] = Field(
        "auto", description="cpu runs the learner_gpus ranks on the CPU with gloo"
    )
    weight_transfer: Literal["auto", "nccl", "file"] = Field(
        "auto",
        description="auto: NCCL to vLLM servers started here (full weights), else files",
    )
    lora_rank: int = Field(
        0, ge=0, le=512, description="LoRA run: the learner's rank and the servers' LoRA slots"
    )
    max_model_len: int | None = Field(None, ge=2, description="servers' context limit")
    served_model_name: str = Field("policy", min_length=1, description="vLLM's model name")
    vllm_bin: str = Field("vllm", min_length=1, description="the command that runs `vllm serve`")
    vllm_args: list[str] = Field(
        default_factory=list,
        description="extra flag passed to every `vllm serve`",
        json_schema_extra={"flag": "vllm-arg"},
    )
    vllm_ready_timeout_s: float = Field(
        1200.0, gt=0, le=24 * 3600, description="how long a vLLM server may take to be healthy"
    )

    @model_validator(mode="after")
    def _consistent(self) -> GpuSettings:
        if self.inference == "cpu" and (self.inference_gpus or self.tensor_parallel_size > 1):
            raise ValueError("--inference-gpus and --tensor-parallel-size need --inference vllm")
        if self.inference == "vllm":
            if not self.inference_gpus:
                raise ValueError("--inference vllm needs --inference-gpus (e.g. 0-3)")
            if len(self.inference_gpus) % self.tensor_parallel_size:
                raise ValueError(
                    f"{len(self.inference_gpus)} --inference-gpus do not split into servers of "
                    f"--tensor-parallel-size {self.tensor_parallel_size}"
                )
            if not self.learner_gpus and self.learner_device != "cpu":
                raise ValueError(
                    "--inference vllm needs --learner-gpus (GPUs apart from the servers'), "
                    "or --learner-device cpu"
                )
        for name in ("inference_gpus", "learner_gpus"):
            gpus = getattr(self, name)
            if len(set(gpus)) != len(gpus):
                raise ValueError(f"--{name.replace('_', '-')} names a GPU twice: {gpus}")
        if self.learner_device != "cpu" and set(self.inference_gpus) & set(self.learner_gpus):
            shared = sorted(set(self.inference_gpus) & set(self.learner_gpus))
            raise ValueError(f"GPUs {shared} are in both --inference-gpus and --learner-gpus")
        return self

    @property
    def server_gpus(self) -> list[list[int]]:
        """The GPUs of each vLLM server, in order."""
        tp = self.tensor_parallel_size
        return [self.inference_gpus[i : i + tp] for i in range(0, len(self.inference_gpus), tp)]

    @property
    def max_lora_rank(self) -> int:
        """vLLM's --max-lora-rank for this run: the smallest value it accepts >= lora_rank."""
        return next(r for r in VLLM_LORA_RANKS if r >= self.lora_rank)

    @property
    def learner_on_gpus(self) -> bool:
        return bool(self.learner_gpus) and self.learner_device != "cpu"

    @property
    def wants_gpus(self) -> bool:
        return self.inference == "vllm" or self.learner_on_gpus

    def nccl_transfer(self, servers_given: bool) -> bool:
        """Whether the learner pushes over vLLM's NCCL routes: asked for, or (auto) to
        full-weight vLLM servers started on this node by a learner on GPUs; files otherwise."""
        if self.weight_transfer == "nccl" and self.lora_rank:
            raise ConfigError("a LoRA run pushes adapters as files: not --weight-transfer nccl")
        if self.weight_transfer != "auto":
            return self.weight_transfer == "nccl"
        return (
            self.inference == "vllm"
            and not servers_given
            and not self.lora_rank
            and self.learner_on_gpus
        )


def check_node(gpus: GpuSettings, nccl: bool, visible: list[str] | None, python: str) -> None:
    """StartupError unless this machine has what `gpus` needs: GPUs, the vLLM command, and
    vLLM importable by the learner's `python` for an NCCL weight transfer."""
    if gpus.wants_gpus and not visible:
        raise StartupError(
            "no NVIDIA GPU found (nvidia-smi lists none, or it is missing and "
            "CUDA_VISIBLE_DEVICES is unset): --inference vllm and --learner-gpus need GPUs; "
            "--learner-device cpu runs the learner's ranks on the CPU"
        )
    if gpus.inference == "vllm" and shutil.which(gpus.vllm_bin) is None:
        raise StartupError(
            f"{gpus.vllm_bin!r} is not on PATH: install vLLM 0.33 (pip install "
            "'rollout-farm[gpu]') or give its command with --vllm-bin"
        )
    if nccl and importlib.util.find_spec("vllm") is None:
        raise StartupError(
            "NCCL weight transfer needs vLLM importable by the learner's Python "
            f"({python}): install vLLM 0.33 there, or pass --weight-transfer file"
        )


def visible_gpus() -> list[str] | None:
    """The devices this process may use, by the names CUDA_VISIBLE_DEVICES takes; None when
    unknown (no CUDA_VISIBLE_DEVICES and no nvidia-smi)."""
    given = os.environ.get("CUDA_VISIBLE_DEVICES")
    if given is not None:
        return [d.strip() for d in given.split(",") if d.strip()]
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    try:
        done = subprocess.run(
            [smi, "--query-gpu=index", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    if done.returncode != 0:
        return []
    return [line.strip() for line in done.stdout.splitlines() if line.strip()]


def cuda_devices(gpus: list[int], visible: list[str] | None) -> str:
    """CUDA_VISIBLE_DEVICES for a child given `gpus` (numbers into `visible`); ValueError
    when one is not there."""
    if visible is None:  # unknown (a dry run on a machine without GPUs): the numbers as given
        return ",".join(map(str, gpus))
    missing = [g for g in gpus if g >= len(visible)]
    if missing:
        raise ValueError(
            f"GPU {missing[0]} does not exist here: {len(visible)} visible"
            + (f" ({','.join(visible)})" if visible else "")
        )
    return ",".join(visible[g] for g in gpus)
