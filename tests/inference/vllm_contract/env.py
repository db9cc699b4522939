"""The vLLM 0.33 contract environment: vLLM's pure-Python source plus the small deps it imports.

A real `pip install vllm` pulls a CUDA stack and pins transformers, so the contract suite never
installs vLLM into the project venv. Instead `ensure_env()` builds, once, a directory that is put
on PYTHONPATH of a separate process (the stub server, tests/inference/vllm_contract/stub_server.py):

- the wheel from `pip download --no-deps vllm==0.33.0`, unpacked without its compiled `.so`
  files (importing the routers, protocol models and weight-transfer engines needs none);
- `pip install --no-deps --target` of the pure or small packages those imports reach (the
  list below was found by importing the modules the suite mounts until nothing was missing).

Torch, transformers, pydantic, numpy, aiohttp, ... come from the project venv underneath.
The result is cached in `$FARM_VLLM_CONTRACT_DIR` (default `~/.cache/rollout-farm/vllm-0.33.0`),
stamped with a hash of the pins; a changed pin rebuilds it. The runtime-LoRA router's own
dependencies (`LORA_ROUTER_DEPS`) go to a second directory beside it (`<dir>-lora`), and Triton
(`TRITON_DEPS`, for running vLLM's GPU sampling kernels in Triton's interpreter on the CPU) to
a third (`<dir>-triton`). `python -m tests.inference.vllm_contract.env` builds them ahead of
time (scripts/bootstrap.sh does).
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

VLLM_VERSION = "0.33.0"
# What importing vLLM 0.33's completion/RL/rpc/cache/health routers, exception handlers,
# auth middleware and NCCL weight-transfer engine needs beyond the project venv.
DEPS = (
    "fastapi==0.136.3",
    "starlette==1.10.0",
    "uvicorn==0.54.0",
    "annotated-doc==0.0.7",
    "anyio==4.16.0",
    "h11==0.16.0",
    "click==8.5.1",
    "sniffio==1.3.1",
    "cbor2==6.3.0",
    "psutil==7.2.2",
    "pyzmq==27.3.0",
    "msgspec==0.22.0",
    "cachetools==8.0.1",
    "pybase64==1.5.1",
    "blake3==1.0.11",
    "openai==3.54.0",
    "distro==1.9.0",
    "jiter==0.19.0",
    "httpx==0.28.1",
    "httpcore==1.0.9",
    "certifi==2026.10.18",
    "idna==3.20",
    "tqdm==4.70.1",
    "openai-harmony==0.0.8",
    "cloudpickle==3.1.2",
    "py-cpuinfo==9.0.0",
    "xgrammar==0.2.8",
    "apache-tvm-ffi==0.1.11",
    "partial-json-parser==0.2.1.1.post7",
    "llguidance==1.7.3",
    "watchfiles==1.3.0",
    "einops==0.8.2",
)


# What importing vLLM 0.33's runtime-LoRA router (`entrypoints/serve/lora/api_router.py`) needs
# beyond DEPS: its SageMaker route aliases. Kept in a directory of their own, beside the main
# one, so adding them did not rebuild (and re-download) the cached vLLM environment.
LORA_ROUTER_DEPS = ("model-hosting-container-standards==0.1.16", "jmespath==1.1.0")


# What importing vLLM 0.33's tool and reasoning parsers needs beyond DEPS: its engine-based
# parsers import `vllm.parser.mistral`, which reads `ijson` and `mistral_common`. A directory of
# their own (`<dir>-parsers`), like LORA_ROUTER_DEPS, so the main environment is not rebuilt.
PARSER_DEPS = (
    "ijson==3.6.0",
    "mistral-common==1.13.1",
    "pydantic-extra-types==2.11.1",
    "pycountry==26.2.16",
)

# Triton for vLLM 0.33's Triton kernels, run by Triton's interpreter (`TRITON_INTERPRET=1`) on
# the CPU: 3.8.0 is the version torch 2.14.0, the torch vLLM 0.33 requires, pins. Its
# interpreter needs no GPU and works beside the project's CPU torch. Only the contract
# processes put it on their path: the project venv never imports Triton.
TRITON_DEPS = ("triton==3.8.0",)


def default_dir() -> Path:
    explicit = os.environ.get("FARM_VLLM_CONTRACT_DIR")
    if explicit:
        return Path(explicit)
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    return cache / "rollout-farm" / f"vllm-{VLLM_VERSION}"


def _stamp(*pins: str) -> str:
    return hashlib.sha256("\n".join((VLLM_VERSION, *pins)).encode()).hexdigest()[:16]


def ensure_env(root: Path | None = None) -> Path:
    """The directory to put on PYTHONPATH; built on first use, reused while the pins hold."""
    return _ensure(Path(root or default_dir()), DEPS, with_vllm=True)


def ensure_lora_router_env(root: Path | None = None) -> Path:
    """The second PYTHONPATH directory: LORA_ROUTER_DEPS, built on first use like the first."""
    main = default_dir()
    return _ensure(Path(root or main.with_name(main.name + "-lora")), LORA_ROUTER_DEPS)


def ensure_parser_env(root: Path | None = None) -> Path:
    """The third PYTHONPATH directory: PARSER_DEPS, built on first use like the first."""
    main = default_dir()
    return _ensure(Path(root or main.with_name(main.name + "-parsers")), PARSER_DEPS)


def ensure_triton_env(root: Path | None = None) -> Path:
    """The fourth PYTHONPATH directory: TRITON_DEPS, built on first use like the first."""
    main = default_dir()
    return _ensure(Path(root or main.with_name(main.name + "-triton")), TRITON_DEPS)


def _ensure(root: Path, deps: tuple[str, ...], with_vllm: bool = False) -> Path:
    root.parent.mkdir(parents=True, exist_ok=True)
    with open(root.parent / f".{root.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one builder at a time; the others reuse its result
        stamp = root / ".farm-stamp"
        if stamp.is_file() and stamp.read_text() == _stamp(*deps):
            return root
        build = root.parent / f".{root.name}.build-{os.getpid()}"
        shutil.rmtree(build, ignore_errors=True)
        build.mkdir()
        if with_vllm:
            _unpack_vllm(build)
        _pip("install", "--no-deps", "--no-compile", "--target", str(build), *deps)
        (build / ".farm-stamp").write_text(_stamp(*deps))
        shutil.rmtree(root, ignore_errors=True)
        os.replace(build, root)
        return root


def _pip(*args: str) -> None:
    cmd = [sys.executable, "-m", "pip", "-q", "--disable-pip-version-check", *args]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr[-2000:]}")


def _unpack_vllm(target: Path) -> None:
    wheels = target / ".wheel"
    _pip("download", "--no-deps", f"vllm=={VLLM_VERSION}", "-d", str(wheels))
    (wheel,) = wheels.glob("vllm-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        # Compiled kernels are never imported by the suite; leaving them out saves ~150 MB.
        members = [m for m in zf.namelist() if not m.endswith(".so")]
        zf.extractall(target, members)
    shutil.rmtree(wheels)


if __name__ == "__main__":
    print(ensure_env())
    print(ensure_lora_router_env())
    print(ensure_parser_env())
    print(ensure_triton_env())
