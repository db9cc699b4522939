"""The one-machine stack: which processes `farm up` runs, with which flags, in which order.

`prepare()` readies the run directory (the tiny model when no model is given, the
task file when none is given) and `build_stack()` turns a `FarmConfig` into the
supervisor's `ProcessSpec`s, in start order: a private `redis-server` (own
directory, AOF on) unless a Redis URL is given, the inference servers unless
inference URLs are given (the CPU policy server, or with `--inference vllm` one
`vllm serve` per tensor-parallel group of `--inference-gpus`, started together:
`farm.vllm`; the learner and workers start while the CPU server loads, after the
vLLM servers are up), the learner (under torchrun with one rank per `--learner-gpus` entry:
`farm.torchrun`), then the workers. The learner's and each
worker's command line is its typed config (`LearnerConfig`, `WorkerConfig`: the run's
shared fields, then its own), validated here and rendered to flags with
`launch.settings.render_flags`; the user's `--learner-arg`/`--worker-arg` follow and
win. The learner pushes weights over NCCL to vLLM servers it started on this node
(full-weight runs with the learner on GPUs), as files otherwise. Each role gets its own
free metrics port; the console view scrapes them. `dry_run()` lists the commands
instead. Layout of the run directory:

    <work_dir>/model/        tiny model (when built here)
    <work_dir>/redis/        the private Redis's AOF
    <work_dir>/weights/      weight versions the learner pushes to the servers
    <work_dir>/checkpoints/  learner checkpoints (a restarted learner resumes from them)
    <work_dir>/tasks.jsonl   the learner's dataset (when written here)
"""

from __future__ import annotations

import asyncio
import json
import shlex
import shutil
import socket
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
from redis.exceptions import RedisError

from broker.cli_config import BrokerCliConfig
from broker.connection import RedisSettings
from broker.run import RunSection
from farm.config import FarmConfig
from farm.errors import ConfigError, StartupError
from farm.gpus import GpuSettings, check_node, cuda_devices, visible_gpus
from farm.monitor import prometheus_spec
from farm.supervisor import LineSink, Probe, ProcessSpec
from farm.torchrun import learner_command
from farm.vllm import LORA_SLOTS, VllmServe
from farm.vllm import servers as vllm_servers
from launch.settings import render_flags
from learner.config import LearnerConfig
from workers.config import WorkerConfig

PYTHON = sys.executable


@dataclass(frozen=True)
class Stack:
    """The resolved stack: its processes and the addresses the farm itself uses."""

    specs: tuple[ProcessSpec, ...]
    redis_url: str
    inference_urls: tuple[str, ...]
    model: Path
    tasks: Path
    prometheus_url: str | None = None  # --monitor's Prometheus

    @property
    def metrics_urls(self) -> dict[str, str]:
        return {s.name: s.metrics_url for s in self.specs if s.metrics_url}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_paths(cfg: FarmConfig) -> tuple[Path, Path]:
    """Where the run's model and task file are (given, or made in the run directory)."""
    work = cfg.work_dir.resolve()
    model = cfg.model.resolve() if cfg.model else work / "model"
    return model, cfg.tasks.resolve() if cfg.tasks else work / "tasks.jsonl"


def _builds_model(cfg: FarmConfig, model: Path) -> bool:
    return cfg.model is None and not (model / "config.json").is_file()


def _build_model_argv(model: Path) -> list[str]:
    return [PYTHON, "-m", "inference.tiny", str(model)]


def command_line(spec: ProcessSpec) -> str:
    """`spec` as one shell line: the variables the farm sets, then the command."""
    return shlex.join([*(f"{k}={v}" for k, v in spec.env.items()), *spec.argv])


def dry_run(cfg: FarmConfig) -> list[str]:
    """What `farm up` would run, as a shell script: each command under a comment naming it.
    Nothing is started or written; GPUs and vLLM are not looked for."""
    model, tasks = run_paths(cfg)
    lines = []
    if _builds_model(cfg, model):
        lines += ["# build-model", shlex.join(_build_model_argv(model))]
    for spec in build_stack(cfg, model, tasks, dry_run=True).specs:
        lines += [f"# {spec.name}", command_line(spec)]
    return lines


async def prepare(cfg: FarmConfig, sink: LineSink) -> tuple[Path, Path]:
    """Make the run directory; build the tiny model and the task file when not given."""
    cfg.work_dir.resolve().mkdir(parents=True, exist_ok=True)
    model, tasks = run_paths(cfg)
    if _builds_model(cfg, model):
        sink("farm", f"building the tiny model in {model}")
        await _run_to_completion("build-model", _build_model_argv(model), sink, 300)
    if not (model / "config.json").is_file():
        raise StartupError(f"no model at {model} (config.json missing)")
    if cfg.tasks is None:
        tasks.write_text(json.dumps({"env_spec": cfg.env_spec}) + "\n")
    elif not tasks.exists():  # a file, or a directory `datasets` saved
        raise StartupError(f"task file {tasks} does not exist")
    return model, tasks


async def _run_to_completion(name: str, argv: list[str], sink: LineSink, limit_s: float) -> None:
    proc = await asyncio.create_subprocess_exec(
        *argv, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT
    )
    try:
        out, _ = await asyncio.wait_for(proc.communicate(), limit_s)
    except TimeoutError as exc:
        proc.kill()
        await proc.wait()
        raise StartupError(f"{name} took longer than {limit_s:.0f}s") from exc
    if proc.returncode != 0:
        for line in out.decode("utf-8", "replace").splitlines()[-20:]:
            sink(name, line)
        raise StartupError(f"{name} failed with status {proc.returncode}")


def run_section(cfg: FarmConfig, redis_url: str) -> RunSection:
    """The settings every role of the stack must agree on.

    Rendered with `render_flags`, the resolver's inverse, so a setting added to
    `broker.run.RunFields` reaches the learner, the workers and `farm eval` alike.
    """
    return RunSection.of(cfg, redis_url=redis_url)


def build_stack(cfg: FarmConfig, model: Path, tasks: Path, *, dry_run: bool = False) -> Stack:
    """The stack's processes in start order. Unless `dry_run` (which only prints them), this
    machine is checked for what they need (GPUs, vLLM) and Redis's directory is made."""
    work = cfg.work_dir.resolve()
    gpus = cfg.gpu
    specs: list[ProcessSpec] = []
    prometheus_url = None
    if cfg.monitor.monitor:  # first: it scrapes every child from its start
        prometheus_url = f"http://127.0.0.1:{cfg.monitor.prometheus_port or free_port()}"
        ready = _http_ok(f"{prometheus_url}/-/ready")
        port = int(prometheus_url.rsplit(":", 1)[1])
        specs.append(prometheus_spec(cfg.monitor, work, port, ready, dry_run=dry_run))
    redis_url = cfg.redis_url
    if redis_url is None:
        redis_spec, redis_url = _redis(work / "redis", cfg.redis_port or free_port(), dry_run)
        specs.append(redis_spec)
    if cfg.archive is not None:  # before the learner: nothing is trimmed before it is archived
        specs += _archivers(cfg, redis_url)
    inference_urls = list(cfg.inference_urls)
    if inference_urls and gpus.inference == "vllm":
        raise ConfigError("--inference vllm starts the servers: leave out --inference-urls")
    visible = None if dry_run or not gpus.wants_gpus else visible_gpus()
    nccl = gpus.nccl_transfer(servers_given=bool(inference_urls))
    if not dry_run:
        check_node(gpus, nccl, visible, PYTHON)
    if not inference_urls and gpus.inference == "vllm":
        servers = _vllm_servers(cfg, model, visible, nccl)
        specs += [_vllm_spec(gpus, i, server) for i, server in enumerate(servers)]
        inference_urls = [s.url for s in servers]
    elif not inference_urls:
        port = cfg.inference_port or free_port()
        inference_urls = [f"http://127.0.0.1:{port}"]
        specs.append(_policy_server(model, port, gpus))
    shared = {
        **run_section(cfg, redis_url).model_dump(),
        "inference_urls": inference_urls,
        "model": model,
    }
    specs.append(_learner(cfg, work, tasks, shared, nccl=nccl, visible=visible))
    for i in range(cfg.workers):
        specs.append(_worker(cfg, i, shared))
    return Stack(tuple(specs), redis_url, tuple(inference_urls), model, tasks, prometheus_url)


def _redis(directory: Path, port: int, dry_run: bool) -> tuple[ProcessSpec, str]:
    binary = shutil.which("redis-server")
    if binary is None:
        raise StartupError("redis-server is not installed; install it or pass --redis-url")
    if not dry_run:
        directory.mkdir(parents=True, exist_ok=True)
    argv = (
        binary,
        "--port",
        str(port),
        "--bind",
        "127.0.0.1",
        "--dir",
        str(directory),
        "--appendonly",
        "yes",
        "--appendfsync",
        "everysec",
        "--save",
        "",
        "--protected-mode",
        "yes",
        "--daemonize",
        "no",
    )
    url = f"redis://127.0.0.1:{port}/0"

    async def ready() -> bool:
        client = RedisSettings.from_url(url, socket_timeout_s=1.0, connect_timeout_s=1.0).client()
        try:
            return bool(await client.ping())
        except (RedisError, OSError):
            return False
        finally:
            await client.aclose()

    # Redis stops last and gets time to finish its AOF rewrite on SIGTERM.
    return ProcessSpec("redis", argv, ready=ready, ready_timeout_s=30, stop_timeout_s=30), url


def _archivers(cfg: FarmConfig, redis_url: str) -> list[ProcessSpec]:
    """One following archiver per trajectories stream: partition 0 into `--archive` itself
    (the directory `--replay` reads), partition p > 0 into its `partition-p` subdirectory."""
    assert cfg.archive is not None
    root = cfg.archive.resolve()
    run = run_section(cfg, redis_url).model_dump(include={"run", "redis_url", "partitions"})
    broker = BrokerCliConfig.model_validate(run)
    specs = []
    for p in range(cfg.partitions):
        out = root if p == 0 else root / f"partition-{p}"
        stream = "trajectories" if p == 0 else f"trajectories:{p}"
        argv = [PYTHON, "-m", "broker", *render_flags(broker), "archive", stream]
        argv += ["--out", str(out), "--follow"]
        # its SIGTERM handler writes what it holds as a last segment
        specs.append(ProcessSpec(f"archiver-{p}", tuple(argv), stop_timeout_s=30))
    return specs


def _policy_server(model: Path, port: int, gpus: GpuSettings) -> ProcessSpec:
    url = f"http://127.0.0.1:{port}"
    argv = [PYTHON, "-m", "inference", "--model", str(model), "--host", "127.0.0.1"]
    if gpus.lora_rank:  # the same adapter slots as vLLM's (farm.vllm)
        argv += ["--enable-lora", "--max-lora-rank", str(gpus.max_lora_rank)]
        argv += ["--max-loras", str(LORA_SLOTS)]
    if gpus.max_model_len is not None:
        argv += ["--max-model-len", str(gpus.max_model_len)]
    return ProcessSpec(
        "inference",
        (*argv, "--port", str(port)),
        ready=_http_ok(f"{url}/health"),
        ready_timeout_s=180,
        metrics_url=f"{url}/metrics",
        # The learner and workers import while it loads: a worker takes tasks only once a
        # server answers /health (workers.__main__), and the learner needs none before its
        # first push, after a batch the server produced.
        gate_start=False,
    )


def _vllm_servers(
    cfg: FarmConfig, model: Path, visible: list[str] | None, nccl: bool
) -> list[VllmServe]:
    groups = cfg.gpu.server_gpus
    ports = [
        cfg.inference_port + i if cfg.inference_port else free_port() for i in range(len(groups))
    ]
    try:
        devices = [cuda_devices(group, visible) for group in groups]
    except ValueError as exc:
        raise StartupError(f"--inference-gpus: {exc}") from exc
    return vllm_servers(cfg.gpu, model, ports, devices, nccl)


def _vllm_spec(gpus: GpuSettings, index: int, server: VllmServe) -> ProcessSpec:
    return ProcessSpec(
        f"vllm-{index}",
        server.argv(gpus.vllm_bin),
        env=server.env(),
        ready=_http_ok(f"{server.url}/health"),
        ready_timeout_s=gpus.vllm_ready_timeout_s,
        stop_timeout_s=60,
        metrics_url=f"{server.url}/metrics",
        start_group="vllm",  # the servers load their model at the same time
    )


def _learner(
    cfg: FarmConfig,
    work: Path,
    tasks: Path,
    shared: dict[str, Any],
    *,
    nccl: bool,
    visible: list[str] | None,
) -> ProcessSpec:
    port = free_port()
    gpus = cfg.gpu
    own: dict[str, Any] = {
        "tasks": tasks,
        "metrics_port": port,
        "weights_dir": work / "weights",
        "checkpoint_dir": work / "checkpoints",
        "resume": True,
        "max_steps": cfg.max_steps,
        "data": cfg.data,
        "progress": cfg.progress,
        "streams": cfg.streams,
    }
    if gpus.learner_device != "auto":
        own["device"] = gpus.learner_device
    if gpus.lora_rank:
        own["lora"] = {"rank": gpus.lora_rank}
    if nccl:  # the servers on this node join the learner's group at 127.0.0.1
        own["weight_transfer"] = "nccl"
        own["transfer"] = {"master_address": "127.0.0.1", "master_port": free_port()}
    child = LearnerConfig.model_validate({**shared, **own})
    flags = [*render_flags(child), *cfg.learner_args]
    argv: tuple[str, ...] = (PYTHON, "-m", "learner", *flags)
    env: dict[str, str] = {}
    if gpus.learner_gpus:  # one rank per GPU (or CPU rank with --learner-device cpu)
        argv, env = learner_command(PYTHON, len(gpus.learner_gpus), flags, cfg.run)
        if gpus.learner_on_gpus:
            try:
                env["CUDA_VISIBLE_DEVICES"] = cuda_devices(gpus.learner_gpus, visible)
            except ValueError as exc:
                raise StartupError(f"--learner-gpus: {exc}") from exc
    return ProcessSpec(
        "learner",
        argv,
        env=env,
        finishes_stack=cfg.max_steps > 0,
        # 2: bad config or task dataset, 3: the run is failing; restarting repeats either
        fatal_exit_codes=frozenset({2, 3}),
        stop_timeout_s=60,  # lets it finish a checkpoint
        metrics_url=f"http://127.0.0.1:{port}/metrics",
    )


def _worker(cfg: FarmConfig, index: int, shared: dict[str, Any]) -> ProcessSpec:
    port = free_port()
    own: dict[str, Any] = {
        # A stable id: a restarted worker first takes back its own pending tasks.
        "worker_id": f"farm-worker-{index}",
        "metrics_port": port,
    }
    if cfg.worker_concurrency:
        own["concurrency"] = cfg.worker_concurrency
    if cfg.sandbox_backend:
        own["sandbox_backend"] = cfg.sandbox_backend
    child = WorkerConfig.model_validate({**shared, **own})
    return ProcessSpec(
        f"worker-{index}",
        (PYTHON, "-m", "workers", *render_flags(child), *cfg.worker_args),
        stop_timeout_s=45,  # its own shutdown grace is 30 s
        metrics_url=f"http://127.0.0.1:{port}/metrics",
        start_group="workers",  # stopped together, not one grace after another
    )


def _http_ok(url: str) -> Probe:
    timeout = aiohttp.ClientTimeout(total=2.0)

    async def ready() -> bool:
        try:
            async with (
                aiohttp.ClientSession(timeout=timeout) as session,
                session.get(url) as response,
            ):
                return response.status == 200
        except (aiohttp.ClientError, TimeoutError, OSError):
            return False

    return ready
