"""Configuration of the sandbox pool: backend, container shape, pool sizing, limits.

One pydantic model per concern, all frozen and with unknown keys rejected. `Limits`
are the per-call limits the agent applies to every child; the container limits
(`memory_mb`, `cpus`, `pids`) bound the whole sandbox on top of them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

Backend = Literal["docker", "bwrap", "unsafe-no-isolation"]


class Limits(BaseModel):
    """Per-call limits, applied by the agent as rlimits and watchdogs on each child."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    timeout_s: float = Field(
        10.0, gt=0, le=3600, description="Default wall-clock timeout of a call."
    )
    cpu_s: int = Field(
        0,
        ge=0,
        le=3600,
        description="RLIMIT_CPU in seconds; 0 means ceil(timeout) + 1 of the call.",
    )
    memory_mb: int = Field(512, ge=16, le=1 << 20, description="RLIMIT_AS of each call, MiB.")
    processes: int = Field(
        64,
        ge=4,
        le=100_000,
        description="Processes a call may add (RLIMIT_NPROC, on top of the sandbox's own).",
    )
    file_size_mb: int = Field(64, ge=1, le=1 << 20, description="RLIMIT_FSIZE of each call, MiB.")
    open_files: int = Field(256, ge=16, le=1 << 20, description="RLIMIT_NOFILE of each call.")
    output_kb: int = Field(
        64,
        ge=1,
        le=64 * 1024,
        description="Cap on captured stdout and on stderr, KiB each; past it the call is killed.",
    )
    collect_kb: int = Field(4096, ge=1, le=1 << 20, description="Cap on each collected file, KiB.")

    def wire(self, timeout_s: float, baseline_processes: int = 0) -> dict[str, int]:
        """The limits as the agent's `run` request carries them.

        RLIMIT_NPROC counts every process of the sandbox uid, so the sandbox's own
        (agent, session processes and their standby children) are added on top.
        """
        cpu = self.cpu_s or int(timeout_s) + 1
        return {
            "cpu_s": cpu,
            "memory_bytes": self.memory_mb << 20,
            "processes": self.processes + baseline_processes,
            "file_size_bytes": self.file_size_mb << 20,
            "open_files": self.open_files,
            "output_bytes": self.output_kb << 10,
            "collect_bytes": self.collect_kb << 10,
        }


class SandboxConfig(BaseModel):
    """Everything a `SandboxPool` needs; see docs/sandbox.md for the security model."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    backend: Backend = Field(
        "docker",
        description="docker (default), bwrap (Linux without an engine), or the loudly named "
        "unsafe-no-isolation, which runs code as the host user with rlimits only.",
    )
    image: str | None = Field(
        None, description="Docker image; None means the content-tagged image of sandbox.image."
    )
    runtime: str | None = Field(None, description="Docker runtime, e.g. 'runsc' for gVisor.")
    auto_build: bool = Field(
        True,
        description="Build the default (content-tagged) image at start-up when it is missing.",
    )
    memory_mb: int = Field(1024, ge=32, le=1 << 20, description="Memory limit of one sandbox, MiB.")
    cpus: float = Field(1.0, gt=0, le=256, description="CPU limit of one sandbox (docker).")
    pids: int = Field(256, ge=16, le=1 << 20, description="pids limit of one sandbox (docker).")
    work_mb: int = Field(
        256, ge=1, le=1 << 20, description="Size of the tmpfs work directory, MiB."
    )
    sessions_per_sandbox: int = Field(
        16,
        ge=1,
        le=4096,
        description="Sessions sharing one sandbox (each its own process and work dir); "
        "1 is strict isolation.",
    )
    warm: int = Field(1, ge=0, le=4096, description="Sandboxes kept started ahead of demand.")
    max_sandboxes: int = Field(16, ge=1, le=100_000, description="Most sandboxes alive at once.")
    acquire_timeout_s: float = Field(
        30.0, gt=0, le=3600, description="How long session() waits for a free slot."
    )
    start_timeout_s: float = Field(
        30.0, gt=0, le=600, description="How long a sandbox may take to answer its first ping."
    )
    recycle_after: int = Field(
        100,
        ge=1,
        le=1_000_000,
        description="Replace a sandbox after it has served this many sessions.",
    )
    health_interval_s: float = Field(
        10.0, gt=0, le=3600, description="Period of the ping health check of idle sandboxes."
    )
    socket_dir: Path = Field(
        Path("/tmp/rollout-farm-sandbox"),
        description="Host directory for the agents' socket directories (keep the path short: "
        "unix socket paths are limited to 108 bytes).",
    )
    uid_base: int = Field(
        200_000,
        ge=1000,
        le=2**31 - 2_000_000,
        description="Sandboxes run as distinct uids in [uid_base, uid_base + 1e6), so "
        "RLIMIT_NPROC and signals do not span two sandboxes; keep the range free of "
        "real users.",
    )
    python_mode: Literal["persistent", "fork"] = Field(
        "persistent",
        description="How run_python executes: 'persistent' reuses one interpreter per "
        "session (no fork per call; wall-clock timeout, no per-call CPU rlimit), 'fork' runs "
        "every call in a fresh process with all rlimits. run() always forks.",
    )
    limits: Limits = Field(default_factory=Limits, description="Default per-call limits.")

    @model_validator(mode="after")
    def _check(self) -> SandboxConfig:
        if self.warm > self.max_sandboxes:
            raise ValueError("warm must not exceed max_sandboxes")
        if len(str(self.socket_dir)) > 48:
            raise ValueError("socket_dir must be at most 48 characters (unix socket path limit)")
        return self
