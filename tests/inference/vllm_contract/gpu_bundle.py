"""A small `vllm` package for a GPU machine without vLLM: its sampling kernels, and stand-ins.

scripts/gpu_sampler_check.sh runs vLLM 0.33's real ``apply_top_k_top_p`` and its Triton kernels
on CUDA (tests/inference/vllm_contract/gpu_sampler.py) on a machine that has torch and Triton
but not vLLM, nor the packages vLLM's own ``__init__`` chain imports (pydantic, transformers,
zmq, ...). `build(dest)` copies from the contract environment (env.py) the vLLM files that hold
the sampling maths (`COPIED`), unchanged, and writes small stand-ins (`STANDINS`) for the
modules they import only for platform detection, environment flags and logging: the platform
answers as vLLM's CUDA platform does (``is_cuda``, the SM count of the device). The bundle is
vLLM's code under its Apache-2.0 licence; it is built into an ignored folder, never committed.

``python -m tests.inference.vllm_contract.gpu_bundle DEST`` builds it (about 0.2 MB).
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

from tests.inference.vllm_contract.env import ensure_env

COPIED = (
    "vllm/v1/sample/ops/topk_topp_sampler.py",
    "vllm/v1/sample/ops/topk_topp_triton.py",
    "vllm/v1/worker/gpu/sample/gumbel.py",
    "vllm/v1/worker/gpu/sample/min_p.py",
    "vllm/model_executor/warmup/jit_warmup.py",
    "vllm/model_executor/warmup/jit_warmup_triton_helper.py",
    "vllm/utils/math_utils.py",
    "vllm/utils/gpu_sync_debug.py",
)

_PLATFORM = '''"""Stand-in for vllm.platforms: vLLM's CUDA platform where torch sees a GPU, else none."""
import enum

import torch

from vllm.platforms.interface import DeviceCapability


class CpuArchEnum(enum.Enum):
    X86 = enum.auto()
    ARM = enum.auto()
    POWERPC = enum.auto()
    RISCV = enum.auto()
    OTHER = enum.auto()
    UNKNOWN = enum.auto()


class _Platform:
    def __init__(self) -> None:
        self._cuda = torch.cuda.is_available()
        self.device_type = "cuda" if self._cuda else "cpu"

    def is_cuda(self) -> bool:
        return self._cuda

    def is_cuda_alike(self) -> bool:
        return self._cuda

    def is_rocm(self) -> bool:
        return False

    def is_xpu(self) -> bool:
        return False

    def is_cpu(self) -> bool:
        return False

    def get_device_capability(self, device_id: int = 0) -> DeviceCapability:
        return DeviceCapability(*torch.cuda.get_device_capability(device_id))

    def num_compute_units(self, device_id: int | None = None) -> int:
        index = torch.cuda.current_device() if device_id is None else device_id
        return torch.cuda.get_device_properties(index).multi_processor_count


current_platform = _Platform()
'''

STANDINS = {
    "vllm/__init__.py": '"""A bundle of vLLM 0.33\'s sampling kernels (gpu_bundle.py)."""\n',
    "vllm/envs.py": (
        '"""Stand-in for vllm.envs: the flags the bundled modules read, at their defaults."""\n'
        "VLLM_GPU_SYNC_CHECK = None\n"
        "VLLM_USE_FLASHINFER_SAMPLER = None\n"
        "VLLM_XPU_USE_SAMPLER_KERNEL = False\n"
        "VLLM_BATCH_INVARIANT = False\n"
        "VLLM_TRITON_JIT_WARMUP_NUM_THREADS = 1\n\n\n"
        "def is_set(name: str) -> bool:\n"
        "    return False\n"
    ),
    "vllm/logger.py": (
        '"""Stand-in for vllm.logger: a stdlib logger with vLLM\'s *_once methods."""\n'
        "import logging\n\n\n"
        "class _Logger(logging.LoggerAdapter):\n"
        "    def info_once(self, msg, *args, **kwargs):\n"
        "        self.info(msg, *args)\n\n"
        "    def warning_once(self, msg, *args, **kwargs):\n"
        "        self.warning(msg, *args)\n\n"
        "    def debug_once(self, msg, *args, **kwargs):\n"
        "        self.debug(msg, *args)\n\n\n"
        "def init_logger(name: str) -> _Logger:\n"
        "    return _Logger(logging.getLogger(name), {})\n"
    ),
    "vllm/_aiter_ops.py": (
        '"""Stand-in for vllm._aiter_ops: ROCm\'s aiter is never enabled on CUDA."""\n\n\n'
        "class _Aiter:\n"
        "    @staticmethod\n"
        "    def is_enabled() -> bool:\n"
        "        return False\n\n\n"
        "rocm_aiter_ops = _Aiter()\n"
    ),
    "vllm/config/__init__.py": "",
    "vllm/config/model.py": (
        '"""Stand-in for vllm.config.model: the two names the sampler imports, as vLLM 0.33."""\n'
        "from typing import Literal\n\n"
        'LogprobsMode = Literal["raw_logits", "raw_logprobs", "processed_logits", '
        '"processed_logprobs"]\n'
        'PROCESSED_LOGPROBS_MODES = ("processed_logits", "processed_logprobs")\n'
    ),
    "vllm/platforms/__init__.py": _PLATFORM,
    "vllm/platforms/interface.py": (
        '"""Stand-in for vllm.platforms.interface: DeviceCapability."""\n'
        "from typing import NamedTuple\n\n\n"
        "class DeviceCapability(NamedTuple):\n"
        "    major: int\n"
        "    minor: int\n\n"
        "    def as_version_str(self) -> str:\n"
        '        return f"{self.major}.{self.minor}"\n'
    ),
    "vllm/triton_utils/__init__.py": (
        '"""Stand-in for vllm.triton_utils: Triton is installed (the check needs it)."""\n'
        "import triton\n"
        "import triton.language as tl\n\n"
        "HAS_TRITON = True\n"
    ),
    "vllm/utils/__init__.py": "",
    "vllm/utils/platform_utils.py": (
        '"""Stand-in for vllm.utils.platform_utils: num_compute_units."""\n'
        "from vllm.platforms import current_platform\n\n\n"
        "def num_compute_units(device_id: int | None = None) -> int:\n"
        "    return current_platform.num_compute_units(device_id)\n"
    ),
    "vllm/model_executor/__init__.py": "",
    "vllm/model_executor/warmup/__init__.py": "",
    "vllm/v1/__init__.py": "",
    "vllm/v1/sample/__init__.py": "",
    "vllm/v1/sample/ops/__init__.py": "",
    "vllm/v1/worker/__init__.py": "",
    "vllm/v1/worker/gpu/__init__.py": "",
    "vllm/v1/worker/gpu/sample/__init__.py": "",
}


def build(dest: Path, source: Path | None = None) -> Path:
    """Write the bundle to `dest` (replaced if present) and return it."""
    source = source or ensure_env()
    shutil.rmtree(dest, ignore_errors=True)
    for name in COPIED:
        target = dest / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source / name, target)
    for name, text in STANDINS.items():
        target = dest / name
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text)
    licence = next(source.glob("vllm-*.dist-info/licenses/LICENSE"))
    shutil.copyfile(licence, dest / "LICENSE")
    return dest


if __name__ == "__main__":
    print(build(Path(sys.argv[1]).resolve()))
