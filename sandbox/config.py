"""Configuration of the sandbox pool: backend, container shape, pool sizing, limits.

One pydantic model per concern, all frozen and with unknown keys rejected. `Limits`
are the per-call limits the agent applies to every child; the sandbox limits
(`memory_mb`, `cpus`, `pids`) bound the whole sandbox on top of them, and each session
has a memory share of its own (`memory_plan`): the shares of a sandbox's sessions and
the agent's reserve add up to at most the sandbox's memory, so a session's allocation
within its share never fails because of a neighbour.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

Backend = Literal["docker", "bwrap", "unsafe-no-isolation"]
MAX_TIMEOUT_S = 3600  # the longest timeout a call may ask for
AGENT_MEMORY_MB = 64  # the agent and its short-lived helpers, outside every session's share
DEFAULT_SESSION_MEMORY_MB = 640


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

    def ceiling(self, baseline_processes: int) -> dict[str, int]:
        """The most any call of a session may use, fixed when the session opens: the
        agent clamps every call's limits to it, whoever sent the call."""
        return self.wire(MAX_TIMEOUT_S, baseline_processes)

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
    memory_mb: int | None = Field(
        None,
        ge=32,
        le=1 << 20,
        description="Memory limit of one sandbox, MiB; None: its sessions' shares plus "
        f"{AGENT_MEMORY_MB} MiB for the agent.",
    )
    session_memory_mb: int | None = Field(
        None,
        ge=16,
        le=1 << 20,
        description="Memory of one session, MiB: its processes, its files (tmpfs) and its "
        "shared memory, bounded by a cgroup of its own; None: an equal share of memory_mb "
        f"when that is set, else {DEFAULT_SESSION_MEMORY_MB}.",
    )
    session_ptys: int = Field(
        16, ge=1, le=1024, description="Pseudo-terminals one session may hold (devpts max=)."
    )
    cpus: float = Field(
        1.0, gt=0, le=256, description="CPU limit of one sandbox (a bwrap jail: a CFS quota)."
    )
    pids: int = Field(256, ge=16, le=1 << 20, description="pids limit of one sandbox.")
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

    @property
    def baseline_processes(self) -> int:
        """The sandbox's own processes counted by RLIMIT_NPROC besides a call's (the
        agent, session processes and their spare children)."""
        return 2 * self.sessions_per_sandbox + 2

    @property
    def capacity(self) -> int:
        """Sessions one sandbox serves at once (bwrap: a jail per session)."""
        return 1 if self.backend == "bwrap" else self.sessions_per_sandbox

    def memory_plan(self) -> tuple[int, int]:
        """(memory of one sandbox, memory share of one session), MiB."""
        if self.session_memory_mb is not None:
            session = self.session_memory_mb
        elif self.memory_mb is not None:
            session = (self.memory_mb - AGENT_MEMORY_MB) // self.capacity
        else:
            session = DEFAULT_SESSION_MEMORY_MB
        if self.memory_mb is not None:
            return self.memory_mb, session
        return self.capacity * session + AGENT_MEMORY_MB, session

    @model_validator(mode="after")
    def _check(self) -> SandboxConfig:
        if self.warm > self.max_sandboxes:
            raise ValueError("warm must not exceed max_sandboxes")
        sandbox_mb, session_mb = self.memory_plan()
        if session_mb < 16 or self.capacity * session_mb + AGENT_MEMORY_MB > sandbox_mb:
            raise ValueError(
                f"memory_mb={sandbox_mb} cannot hold {self.capacity} sessions of "
                f"{session_mb} MiB (at least 16) and {AGENT_MEMORY_MB} MiB for the agent"
            )
        if self.work_mb > session_mb:
            raise ValueError(
                f"work_mb={self.work_mb} exceeds a session's memory ({session_mb} MiB): "
                "its files are memory (tmpfs)"
            )
        if len(str(self.socket_dir)) > 48:
            raise ValueError("socket_dir must be at most 48 characters (unix socket path limit)")
        return self
