"""Learner benchmark: throughput with a batch always buffered, and weight-push time.

1. Throughput. Enough groups are published up front that a batch is always waiting,
   then `python -m learner` (a real process, real Redis, the tiny model) trains on
   them; its per-step log gives samples/s, s/step and the share of step time spent
   waiting for data (target <= 5%), and its peak RSS is read when it exits. Baseline in
   the same run: the same batches through `Trainer.step` in-process with no Redis at all
   (the compute ceiling); ratio shown.
   `--model DIR --env SPEC` runs a real model instead, on batches of the environment's
   own prompts (rendered by the worker's chat codec with the model's tokenizer) and
   completions of `--completion-tokens` tokens drawn from its vocabulary, e.g.
   `python -m bench learner --quick --model <SmolLM2 dir> --env arith`.
2. Weight push. A real CPU policy server (`python -m inference`) is started and the
   learner's `WeightPusher` pushes and verifies successive versions. Baseline: writing
   the same weights with `safetensors.save_file` plus fsync (the disk write alone).

Medians are quoted. `--quick` runs fewer steps and pushes (under a minute); `--smoke` one of each
(CI), with the policy server starting during the live run rather than after it.
`--memory` runs the long-sequence memory benchmark instead (`bench/_learner_memory.py`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from bench import _report as report
from broker.connection import RedisSettings, connect
from broker.keys import RunKeys
from broker.messages import Task, Trajectory, TrajectoryGroup, Turn
from broker.producer import Producer
from launch.settings import HelpFormatter

RUN = "bench-learner"
GROUP_SIZE, GROUPS_PER_BATCH, PROMPT, COMPLETION = 8, 8, 64, 64


@dataclass(frozen=True)
class Shape:
    """What a batch looks like: prompts (token ids, cycled over the groups), completion
    length, group size and groups a step, and the vocabulary completions are drawn from."""

    prompts: tuple[tuple[int, ...], ...]
    completion: int
    group_size: int
    groups_per_batch: int
    vocab: int
    label: str

    def describe(self) -> str:
        lengths = sorted(len(p) for p in self.prompts)
        prompt = f"{lengths[0]}-{lengths[-1]}" if lengths[0] != lengths[-1] else f"{lengths[0]}"
        return (
            f"{self.groups_per_batch} groups x {self.group_size} x ({prompt}+{self.completion}) "
            f"tokens, {self.label}"
        )


def tiny_shape() -> Shape:
    rng = np.random.default_rng(1)
    prompt = tuple(int(x) for x in rng.integers(0, 256, PROMPT))
    return Shape((prompt,), COMPLETION, GROUP_SIZE, GROUPS_PER_BATCH, 256, "tiny model")


def env_shape(model_dir: Path, spec: str, args: argparse.Namespace) -> Shape:
    """The prompts a worker would send for `spec`'s first episodes, rendered by the worker's
    own chat codec with `model_dir`'s tokenizer; completions of `--completion-tokens`."""
    from envs.api import aclose, areset
    from envs.registry import make
    from workers.tokens import ChatCodec, load_tokenizer

    tokenizer = load_tokenizer(str(model_dir))
    codec = ChatCodec(tokenizer)

    async def prompts() -> list[tuple[int, ...]]:
        out = []
        for seed in range(args.groups_per_batch):
            env = make(spec)
            observation, _ = await areset(env, seed=seed)
            ids = codec.initial_prompt(
                observation, getattr(env, "system_prompt", None), getattr(env, "tools", None)
            )
            out.append(tuple(ids))
            await aclose(env)
        return out

    return Shape(
        tuple(asyncio.run(prompts())),
        args.completion_tokens,
        args.group_size,
        args.groups_per_batch,
        len(tokenizer),
        f"{model_dir.name} on {spec}",
    )


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_groups(n: int, shape: Shape, seed: int = 0) -> list[TrajectoryGroup]:
    rng = np.random.default_rng(seed)
    out = []
    for g in range(n):
        task = Task(
            task_id=f"b-{g}",
            env_spec="toy@{}",
            group_size=shape.group_size,
            seed=g,
            policy_version=0,
        )
        prompt = np.array(shape.prompts[g % len(shape.prompts)])
        trajs = tuple(
            Trajectory(
                (
                    Turn(
                        prompt,
                        rng.integers(0, shape.vocab, shape.completion),
                        -rng.uniform(3, 7, shape.completion),
                        0,
                        float(i % 2),
                        True,
                        False,
                    ),
                ),
                "terminated",
                sample_index=i,
            )
            for i in range(shape.group_size)
        )
        out.append(TrajectoryGroup(f"b-{g}", task, trajs, "bench"))
    return out


def start_redis(tmp: Path) -> tuple[subprocess.Popen[bytes], str]:
    port = _free_port()
    proc = subprocess.Popen(
        [
            "redis-server",
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--dir",
            str(tmp),
            "--save",
            "",
            "--appendonly",
            "no",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    time.sleep(0.3)
    return proc, f"redis://127.0.0.1:{port}/0"


def compute_ceiling(
    model_dir: Path, groups: list[TrajectoryGroup], steps: int, per_batch: int
) -> float:
    """Samples/s of Trainer.step alone on the same batches (median over steps)."""
    import torch
    from transformers import AutoModelForCausalLM

    from learner.batch import BatchRules, prepare_batch
    from learner.config import Aggregation, Algorithm
    from learner.distributed import DistContext
    from learner.trainer import OptimConfig, Trainer

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    cfg = OptimConfig(learning_rate=1e-5, micro_batch_size=8, aggregation=Aggregation.TOKEN_MEAN)
    trainer = Trainer(model, cfg, torch.device("cpu"), DistContext())
    rules = BatchRules(Algorithm.GRPO, gamma=1.0, skip_zero_variance=True)
    rates = []
    for s in range(steps + 1):
        batch = groups[s * per_batch : (s + 1) * per_batch]
        prepared = prepare_batch(batch, rules, version=0, judge_staleness=False)
        started = time.perf_counter()
        trainer.step(prepared.samples, prepared.num_tokens, len(prepared.samples))
        if s:  # the first step warms up
            rates.append(len(prepared.samples) / (time.perf_counter() - started))
    return statistics.median(rates)


def live_run(
    model_dir: Path, url: str, groups: list[TrajectoryGroup], steps: int, tmp: Path
) -> dict[str, float]:
    """The learner process on `groups`: samples/s, s/step, waiting share, peak RSS."""

    async def publish() -> None:
        redis = await connect(RedisSettings.from_url(url))
        await Producer(redis).publish(RunKeys(RUN).trajectories(), groups)
        await redis.aclose()

    asyncio.run(publish())
    cmd = [
        sys.executable,
        "-m",
        "learner",
        "--model",
        str(model_dir),
        "--redis-url",
        url,
        "--run",
        RUN,
        "--group-size",
        str(len(groups[0].trajectories)),
        "--groups-per-batch",
        str(len(groups) // (steps + 1)),
        "--max-steps",
        str(steps + 1),
        "--push-interval",
        "0",
        "--checkpoint-dir",
        str(tmp / "ckpt"),
        "--checkpoint-interval",
        "1000",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    # The learner is the first child waited for (Redis and the policy server still run),
    # so the children's peak resident set is the learner's.
    peak_kib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr[-2000:])
    lines = [line for line in proc.stderr.splitlines() if '"event": "step"' in line]
    stamps = [_stamp(line) for line in lines]
    records = [json.loads(line.split(" learner ", 1)[1]) for line in lines][1:]  # first: warm-up
    wait = sum(r["wait_s"] for r in records)
    compute = sum(r["compute_s"] for r in records)
    samples = sum(r["samples"] for r in records)
    return {
        "s_per_step": (stamps[-1] - stamps[0]) / len(records),
        "peak_rss_mib": peak_kib / 1024,
        "samples_per_s": samples / (stamps[-1] - stamps[0]),  # wall clock, log line to line
        "in_run_compute_samples_per_s": samples / compute,
        "wait_share": wait / (wait + compute),
    }


def _stamp(line: str) -> float:
    """Seconds of the logging asctime at the start of a line."""
    from datetime import datetime

    return datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()


@dataclass(frozen=True)
class ModelSource:
    """The file route's `learner.weights.WeightSource` over one in-process model (no ranks)."""

    model: Any
    model_dir: Path

    def export(self, out_dir: Path) -> int:
        from learner.export import export_hf_dir

        return export_hf_dir(self.model, out_dir, True, self.model_dir)

    def weight_stream(self) -> Any:
        raise NotImplementedError("the benchmark pushes through files only")


@contextmanager
def policy_server(model_dir: Path, tmp: Path) -> Iterator[str]:
    """A CPU policy server (`python -m inference`) started, not yet ready; its base URL."""
    port = _free_port()
    log = (tmp / "server.log").open("wb")
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "inference",
            "--model",
            str(model_dir),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.kill()
        server.wait(10)
        log.close()


def push_times(base: str, model_dir: Path, tmp: Path, pushes: int) -> tuple[float, float, int]:
    """(median push+verify s, median safetensors save+fsync s, bytes) against the server at `base`."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    from learner.config import LearnerConfig
    from learner.weights import WeightPusher

    for _ in range(600):
        try:
            urllib.request.urlopen(base + "/health", timeout=1)
            break
        except OSError:
            time.sleep(0.2)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    cfg = LearnerConfig.load({"model": model_dir, "inference_urls": base, "weights_dir": tmp / "w"})
    pusher = WeightPusher(cfg)
    source = ModelSource(model, model_dir)

    async def run() -> list[float]:
        times = []
        for v in range(1, pushes + 1):
            started = time.perf_counter()
            await pusher.push(source, v)
            times.append(time.perf_counter() - started)
        return times

    push = statistics.median(asyncio.run(run()))
    saves = []
    state = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    for i in range(pushes):
        path = tmp / f"raw-{i}.safetensors"
        started = time.perf_counter()
        save_file(state, path)
        fd = os.open(path, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)
        saves.append(time.perf_counter() - started)
    size = sum(v.numel() * v.element_size() for v in state.values())
    return push, statistics.median(saves), size


def main(argv: list[str]) -> int:
    if "--memory" in argv:  # the memory benchmark of long sequences (bench/_learner_memory.py)
        from bench import _learner_memory

        return _learner_memory.main(argv)
    parser = argparse.ArgumentParser(
        prog="python -m bench learner", description=__doc__, formatter_class=HelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="fewer steps (under a minute)")
    parser.add_argument("--smoke", action="store_true", help="one timed step and push (CI)")
    parser.add_argument("--json", action="store_true", help="print JSON (the table to stderr)")
    parser.add_argument(
        "--model", type=Path, help="a local model directory (default: the tiny model, built)"
    )
    parser.add_argument(
        "--env", help="with --model: batches of this environment's prompts (e.g. arith)"
    )
    parser.add_argument("--completion-tokens", type=int, default=12, help="with --env")
    parser.add_argument("--group-size", type=int, default=8, help="with --env")
    parser.add_argument("--groups-per-batch", type=int, default=4, help="with --env")
    args = parser.parse_args(argv)
    if (args.model is None) != (args.env is None):
        parser.error("--model and --env go together: a real model on one environment's prompts")
    run = report.start("learner", argv)
    steps, pushes = (1, 1) if args.smoke else (4, 3) if args.quick else (15, 10)
    from transformers.utils import logging as hf_logging

    from inference.tiny import build_tiny_model

    hf_logging.disable_progress_bar()  # one bar per weight push would bury the table

    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        if args.model is None:
            model_dir, shape = build_tiny_model(tmp / "model", seed=0), tiny_shape()
        else:
            model_dir, shape = args.model, env_shape(args.model, args.env, args)
        groups = make_groups((steps + 1) * shape.groups_per_batch, shape)
        with ExitStack() as stack:
            # --smoke starts the policy server first, so that its start-up (seconds of
            # imports) overlaps the live run; a full run keeps the two apart, as both time.
            early = stack.enter_context(policy_server(model_dir, tmp)) if args.smoke else None
            redis, url = start_redis(tmp)
            try:
                live = live_run(model_dir, url, groups, steps, tmp)
            finally:
                redis.kill()
                redis.wait(10)
            ceiling = compute_ceiling(model_dir, groups, steps, shape.groups_per_batch)
            base = early or stack.enter_context(policy_server(model_dir, tmp))
            push, save, size = push_times(base, model_dir, tmp, pushes)
    result: dict[str, Any] = {
        "s_per_step": round(live["s_per_step"], 3),
        "learner_peak_rss_mib": round(live["peak_rss_mib"], 1),
        "samples_per_s": round(live["samples_per_s"], 1),
        "compute_only_samples_per_s": round(ceiling, 1),
        "throughput_ratio": round(live["samples_per_s"] / ceiling, 3),
        "in_run_compute_samples_per_s": round(live["in_run_compute_samples_per_s"], 1),
        "in_run_ratio": round(live["samples_per_s"] / live["in_run_compute_samples_per_s"], 3),
        "wait_share": round(live["wait_share"], 4),
        "weight_push_s": round(push, 4),
        "safetensors_save_fsync_s": round(save, 4),
        "push_ratio": round(push / save, 1),
        "weight_bytes": size,
        "steps": steps,
        "pushes": pushes,
        "batch": shape.describe(),
    }
    return report.emit(run, result, table(result), args.json)


def table(result: dict[str, Any]) -> str:
    return "\n".join(
        (
            f"learner benchmark ({result['batch']}, CPU), medians",
            f"{'metric':<34}{'farm':>12}{'baseline':>14}{'ratio':>8}",
            f"{'samples/s (batch always buffered)':<34}{result['samples_per_s']:>12}"
            f"{result['compute_only_samples_per_s']:>14}{result['throughput_ratio']:>8}",
            f"{'  vs Trainer.step time, same run':<34}{result['samples_per_s']:>12}"
            f"{result['in_run_compute_samples_per_s']:>14}{result['in_run_ratio']:>8}",
            f"{'s/step (wall, log line to line)':<34}{result['s_per_step']:>12}",
            f"{'learner peak RSS (MiB)':<34}{result['learner_peak_rss_mib']:>12}",
            f"{'share of step time waiting':<34}{result['wait_share']:>12}{'target<=0.05':>14}",
            f"{'weight push + verify (s)':<34}{result['weight_push_s']:>12}"
            f"{result['safetensors_save_fsync_s']:>14}{result['push_ratio']:>8}",
        )
    )
