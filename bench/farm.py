"""`python -m bench farm [--quick|--smoke] [--json] [--backend docker|bwrap|both]`: the farm end to end.

N concurrent multi-turn episodes of the `code` environment (problem `sum-two`, up to 3
attempts, test feedback between them) run by real `python -m workers` processes, each
with its own sandbox pool, reading tasks from a real redis-server and publishing
trajectory groups there. The policy is the load generator (`bench._loadgen --mode
code`): after a log-normal latency it answers with a ```python block holding a passing,
a failing or a slow (sleeps in every test) solution. One env step of `code` is one tool
call: the attempt is compiled and run against the tests in a sandbox session.

Reported over a steady-state window (the workers' Prometheus metrics, scraped before
and after it): episodes/s, tool calls/s, tool-call p50/p99, event-loop lag p99 (worst
worker), sandboxes alive, host memory per episode (MemAvailable drop from before the
workers started). Baseline, same run, same backend and pool sizes: the sandbox-only
ceiling, tool calls (the same evaluation of the same solution mix) driven back to back
from one process with no policy, no broker and no worker in the way.

Worker processes: one per 250 episodes (a worker's default pool holds 16 sandboxes of
16 sessions: 256 sessions at once).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from bench import _report as report
from bench._loadgen import MIX, code_answer
from bench._loadgen_proc import free_port, loadgen
from bench.broker import start_redis
from launch.settings import HelpFormatter

ENV_SPEC = 'code@{"problem_ids": ["sum-two"], "max_attempts": 3}'
EPISODES_PER_WORKER = 250
SLOW_S = 0.3
# bwrap runs, workers and ceiling alike, on asyncio: the figures in BENCHMARKS.md were taken
# so, before the jails' uid switch moved to setpriv and uvloop could start them too.
LOOPS = {"docker": "uvloop", "bwrap": "asyncio"}
HISTOGRAMS = ("farm_worker_sandbox_seconds", "farm_worker_event_loop_lag_seconds")


def mem_available_mb() -> float:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 1024
    return 0.0


def tree_rss_mb(roots: list[int]) -> float:
    """Resident memory of these processes and all their descendants (bwrap jails included)."""
    parent, rss = {}, {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            status = (entry / "status").read_text()
        except OSError:  # exited meanwhile
            continue
        parent[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
        kb = [int(x.split()[1]) for x in status.splitlines() if x.startswith("VmRSS:")]
        rss[int(entry.name)] = kb[0] if kb else 0
    keep, frontier = set(roots), list(roots)
    while frontier:
        pid = frontier.pop()
        for child, ppid in parent.items():
            if ppid == pid and child not in keep:
                keep.add(child)
                frontier.append(child)
    return sum(rss.get(pid, 0) for pid in keep) / 1024


def containers_mb() -> float:
    """Memory charged to the sandbox containers' cgroups (v1 or v2), MiB."""
    from sandbox.docker_backend import LABEL

    ids = subprocess.run(
        ["docker", "ps", "-q", "--no-trunc", "--filter", f"label={LABEL}"],
        capture_output=True,
        text=True,
        timeout=30,
    ).stdout.split()
    used = 0
    for cid in ids:
        for path in (
            f"/sys/fs/cgroup/memory/docker/{cid}/memory.usage_in_bytes",
            f"/sys/fs/cgroup/system.slice/docker-{cid}.scope/memory.current",
        ):
            if Path(path).exists():
                used += int(Path(path).read_text())
                break
    return used / 2**20


@dataclass
class Scrape:
    """Counters and histogram buckets of one worker's /metrics, at one moment."""

    counters: dict[str, float]
    buckets: dict[str, dict[float, float]]  # histogram -> upper bound -> cumulative count


def scrape(port: int, tries: int = 5) -> Scrape:
    """One worker's metrics; retried, as a loaded worker may reset the connection."""
    url = f"http://127.0.0.1:{port}/metrics"
    for attempt in range(tries):
        try:
            with urllib.request.urlopen(url, timeout=10) as resp:
                text = resp.read().decode()
            break
        except OSError:
            if attempt == tries - 1:
                raise
            time.sleep(0.5)
    counters: dict[str, float] = {}
    buckets: dict[str, dict[float, float]] = {h: {} for h in HISTOGRAMS}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name.endswith("_bucket") and family.name in buckets:
                le = float(s.labels["le"])
                buckets[family.name][le] = buckets[family.name].get(le, 0) + s.value
            else:  # summed over labels: episodes of every outcome, sandboxes of every state
                counters[s.name] = counters.get(s.name, 0.0) + s.value
    return Scrape(counters, buckets)


def hist_percentile(before: dict[float, float], after: dict[float, float], q: float) -> float:
    """The q-quantile of the observations between two scrapes, interpolated in its bucket."""
    bounds = sorted(after)
    cum = [after[b] - before.get(b, 0.0) for b in bounds]
    total = cum[-1] if cum else 0.0
    if total <= 0:
        return float("nan")
    lo_bound, lo_cum = 0.0, 0.0
    for bound, c in zip(bounds, cum, strict=True):
        if c >= q * total:
            if bound == float("inf"):
                return lo_bound
            frac = (q * total - lo_cum) / max(c - lo_cum, 1e-9)
            return lo_bound + frac * (bound - lo_bound)
        lo_bound, lo_cum = bound, c
    return lo_bound


def start_workers(
    n: int,
    per_worker: int,
    redis_port: int,
    url: str,
    model: Path,
    *,
    backend: str,
    log_dir: Path,
    grace_s: float,
) -> tuple[list[subprocess.Popen[bytes]], list[int]]:
    procs, ports = [], []
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    for k in range(n):
        port = free_port()
        cmd = [
            sys.executable,
            "-m",
            "workers",
            "--redis-url",
            f"redis://127.0.0.1:{redis_port}",
            "--run",
            "farmbench",
            "--inference-urls",
            url,
            "--model",
            str(model),
            "--worker-id",
            f"bench-{k}",
            "--concurrency",
            str(per_worker),
            "--sandbox-backend",
            backend,
            "--metrics-port",
            str(port),
            "--max-tokens",
            "256",
            "--max-context-tokens",
            "4096",
            "--episode-timeout-s",
            "600",
            "--inference-max-connections",
            str(per_worker),
            "--log-level",
            "WARNING",
            "--shutdown-grace-s",
            str(grace_s),
            "--event-loop",
            LOOPS[backend],
        ]
        log = open(log_dir / f"worker-{k}.log", "wb")
        procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env))
        ports.append(port)
    return procs, ports


def stop_workers(procs: list[subprocess.Popen[bytes]], log_dir: Path) -> None:
    for k, p in enumerate(procs):
        if p.poll() is not None:  # died during the run: show why before the logs go
            log = (log_dir / f"worker-{k}.log").read_text(errors="replace")
            print(f"worker {k} exited {p.returncode}:\n{log[-3000:]}", file=sys.stderr)
    for p in procs:
        p.terminate()
    for p in procs:
        try:
            p.wait(60)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(10)


async def publish(redis_port: int, count: int) -> None:
    from broker.connection import RedisSettings, connect
    from broker.keys import RunKeys
    from broker.messages import Task
    from broker.producer import Producer

    redis = await connect(RedisSettings.from_url(f"redis://127.0.0.1:{redis_port}"))
    try:
        tasks = [
            Task(f"t{i}", ENV_SPEC, group_size=1, seed=i, policy_version=0) for i in range(count)
        ]
        for start in range(0, count, 1000):
            await Producer(redis).publish(RunKeys("farmbench").tasks, tasks[start : start + 1000])
    finally:
        await redis.aclose()


def scrape_all(ports: list[int]) -> list[Scrape]:
    return [scrape(p) for p in ports]


def total(scrapes: list[Scrape], name: str) -> float:
    return sum(s.counters.get(name, 0.0) for s in scrapes)


async def wait_ready(
    ports: list[int], procs: list[subprocess.Popen[bytes]], within_s: float
) -> None:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if any(p.poll() is not None for p in procs):
            raise RuntimeError("a worker exited at start-up; see its log")
        try:
            await asyncio.to_thread(scrape_all, ports)
            return
        except OSError:
            await asyncio.sleep(0.5)
    raise RuntimeError("workers did not open their metrics ports")


async def farm_window(
    ports: list[int],
    pids: list[int],
    backend: str,
    n: int,
    *,
    warm_s: float,
    window_s: float,
    mem0: float,
) -> dict[str, Any]:
    """Wait for the first episodes to finish and the farm to fill, then measure a window."""
    poll_s = min(1.0, window_s / 4)  # scrapes and memory samples: at least 4 in a window
    deadline = time.monotonic() + warm_s
    while time.monotonic() < deadline:
        s = await asyncio.to_thread(scrape_all, ports)
        if total(s, "farm_worker_episodes_total") >= n // 4:
            break
        await asyncio.sleep(poll_s)
    before, t0, low = await asyncio.to_thread(scrape_all, ports), time.monotonic(), mem0
    alive = used = 0.0
    while time.monotonic() < t0 + window_s:
        await asyncio.sleep(poll_s)
        low = min(low, mem_available_mb())
        mem = await asyncio.to_thread(tree_rss_mb, pids)
        if backend == "docker":
            mem += await asyncio.to_thread(containers_mb)
        used = max(used, mem)
        s = await asyncio.to_thread(scrape_all, ports)
        alive = max(alive, total(s, "farm_sandbox_containers"))
    after, wall = await asyncio.to_thread(scrape_all, ports), time.monotonic() - t0

    def delta(name: str) -> float:
        return total(after, name) - total(before, name)

    def pct(hist: str, q: float) -> list[float]:
        return [
            hist_percentile(b.buckets[hist], a.buckets[hist], q)
            for b, a in zip(before, after, strict=True)
        ]

    calls = delta("farm_worker_sandbox_seconds_count")
    merged_b = _merge([b.buckets["farm_worker_sandbox_seconds"] for b in before])
    merged_a = _merge([a.buckets["farm_worker_sandbox_seconds"] for a in after])
    return {
        "episodes": n,
        "workers": len(ports),
        "window_s": wall,
        "episodes_per_s": delta("farm_worker_episodes_total") / wall,
        "tool_calls_per_s": calls / wall,
        "sandbox_runs_per_s": delta("farm_sandbox_run_seconds_count") / wall,
        "tool_p50_ms": hist_percentile(merged_b, merged_a, 0.5) * 1e3,
        "tool_p99_ms": hist_percentile(merged_b, merged_a, 0.99) * 1e3,
        "lag_p99_ms": max(pct("farm_worker_event_loop_lag_seconds", 0.99)) * 1e3,
        "in_flight": total(after, "farm_worker_episodes_in_flight"),
        "sandboxes_alive": alive,
        "mem_per_episode_mb": used / n,
        "mem_available_drop_per_episode_mb": (mem0 - low) / n,
    }


def _merge(parts: list[dict[float, float]]) -> dict[float, float]:
    out: dict[float, float] = {}
    for part in parts:
        for bound, c in part.items():
            out[bound] = out.get(bound, 0.0) + c
    return out


async def sandbox_ceiling(
    backend: str, n: int, workers: int, window_s: float, ramp_s: float
) -> dict[str, float]:
    """Tool calls/s with the sandboxes saturated: as many lanes as the farm has episodes
    (at most the pools' session slots), each evaluating the same solution mix back to
    back, in this process."""
    from envs.code.grading import evaluate, extract_code
    from envs.code.problems import load_problems
    from envs.sandboxed import open_session
    from sandbox import SandboxConfig, SandboxPool

    problem = next(p for p in load_problems() if p.id == "sum-two")
    config = SandboxConfig(backend=backend, max_sandboxes=16 * workers)
    lanes = min(n, config.max_sandboxes * config.sessions_per_sandbox)
    rng, done, times = random.Random(0), 0, []
    measuring = stop = False

    async def lane() -> None:
        nonlocal done
        while not stop:
            kind = rng.choices([m for m, _ in MIX], [w for _, w in MIX])[0]
            code = extract_code(code_answer(kind, SLOW_S))
            t0 = time.perf_counter()
            async with open_session(pool) as sb:
                await evaluate(sb, problem, code, 5.0)
            if measuring:
                done += 1
                times.append(time.perf_counter() - t0)

    async with SandboxPool(config) as pool, asyncio.TaskGroup() as tg:
        for k in range(lanes):
            tg.create_task(lane(), name=f"ceiling:{k}")
        await asyncio.sleep(ramp_s)  # ramp-up: sandboxes start, sessions open
        measuring, t0 = True, time.monotonic()
        await asyncio.sleep(window_s)
        wall, stop = time.monotonic() - t0, True
        measuring = False  # lanes end after their current call (the TaskGroup waits)
    times.sort()
    return {
        "lanes": lanes,
        "tool_calls_per_s": done / wall,
        "p50_ms": times[len(times) // 2] * 1e3 if times else float("nan"),
        "p99_ms": times[int(len(times) * 0.99)] * 1e3 if times else float("nan"),
    }


@dataclass(frozen=True)
class Timing:
    """How long a run waits for what (shorter under `--smoke`)."""

    window_s: float  # the measuring window, of the farm and of the ceiling
    ramp_s: float  # the ceiling's ramp-up before its window
    grace_s: float  # the workers' --shutdown-grace-s: in-flight episodes then cancelled


async def run_backend(backend: str, n: int, timing: Timing, *, tmp: Path, model: Path) -> dict:
    workers = max(1, -(-n // EPISODES_PER_WORKER))
    window_s, ramp_s = timing.window_s, timing.ramp_s
    ceiling = await sandbox_ceiling(backend, n, workers, window_s, ramp_s)
    redis, redis_port = start_redis(tmp)
    procs: list[subprocess.Popen[bytes]] = []
    try:
        async with loadgen(50.0, 0.5, "--mode", "code", "--slow-s", str(SLOW_S)) as url:
            await publish(redis_port, n * 20)  # far more than the window can finish
            mem0 = mem_available_mb()
            procs, ports = start_workers(
                workers,
                -(-n // workers),
                redis_port,
                url,
                model,
                backend=backend,
                log_dir=tmp,
                grace_s=timing.grace_s,
            )
            await wait_ready(ports, procs, 120)
            pids = [p.pid for p in procs]
            farm = await farm_window(
                ports, pids, backend, n, warm_s=4 * window_s, window_s=window_s, mem0=mem0
            )
    finally:
        stop_workers(procs, tmp)
        redis.terminate()
        redis.wait(10)
    ceiling_after = await sandbox_ceiling(backend, n, workers, window_s, ramp_s)
    # Measured before and after the farm (this host is shared and noisy): the higher
    # one is the ceiling, so the ratio errs low.
    ceiling = max(ceiling, ceiling_after, key=lambda c: c["tool_calls_per_s"])
    farm["ratio"] = farm["tool_calls_per_s"] / max(ceiling["tool_calls_per_s"], 1e-9)
    return {"backend": backend, "farm": farm, "ceiling": ceiling}


def table(results: list[dict[str, Any]]) -> str:
    rows = [("backend", "measure", "value", "target / baseline")]
    for r in results:
        f, c, b = r["farm"], r["ceiling"], r["backend"]
        rows += [
            (
                b,
                f"{f['episodes']} episodes, {f['workers']} workers",
                f"{f['episodes_per_s']:.1f} episodes/s",
                f"window {f['window_s']:.0f} s, {f['in_flight']:.0f} in flight at its end",
            ),
            (
                b,
                "tool calls/s (code attempts)",
                f"{f['tool_calls_per_s']:.1f}",
                f"sandbox-only ceiling {c['tool_calls_per_s']:.1f} ({c['lanes']} lanes)",
            ),
            (b, "  ratio to ceiling", f"{f['ratio']:.2f}x", ">= 0.8x"),
            (b, "  sandbox runs/s (compile + tests)", f"{f['sandbox_runs_per_s']:.1f}", ""),
            (
                b,
                "tool call p50 / p99",
                f"{f['tool_p50_ms']:.0f} / {f['tool_p99_ms']:.0f} ms",
                f"ceiling {c['p50_ms']:.0f} / {c['p99_ms']:.0f} ms",
            ),
            (b, "worker loop lag p99 (worst worker)", f"{f['lag_p99_ms']:.1f} ms", "<= 50 ms"),
            (b, "sandboxes alive (peak)", f"{f['sandboxes_alive']:.0f}", ""),
            (
                b,
                "host memory per episode",
                f"{f['mem_per_episode_mb']:.2f} MiB",
                "workers' process trees + sandbox cgroups, peak / episodes",
            ),
            (
                b,
                "  MemAvailable drop per episode",
                f"{f['mem_available_drop_per_episode_mb']:.2f} MiB",
                "whole host: noisy, shared",
            ),
        ]
    width = [max(len(r[i]) for r in rows) for i in range(4)]
    return "\n".join(
        "  ".join(c.ljust(w) for c, w in zip(r, width, strict=True)).rstrip() for r in rows
    )


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench farm", description=__doc__, formatter_class=HelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="100 episodes, short window")
    parser.add_argument("--smoke", action="store_true", help="8 episodes, 1 s windows, bwrap (CI)")
    parser.add_argument("--json", action="store_true", help="print JSON (the table to stderr)")
    parser.add_argument("--episodes", type=int, default=None, help="concurrent episodes")
    parser.add_argument("--window-s", type=float, default=None, help="measuring window")
    parser.add_argument(
        "--backend", choices=("docker", "bwrap", "both"), help="default: both (smoke: bwrap)"
    )
    args = parser.parse_args(argv)
    run = report.start("farm", argv)
    n = args.episodes or (8 if args.smoke else 100 if args.quick else 1000)
    window = args.window_s or (1.0 if args.smoke else 20.0 if args.quick else 60.0)
    timing = (
        Timing(window, ramp_s=1.0, grace_s=1.0)
        if args.smoke
        else Timing(window, ramp_s=max(window / 2, 10.0), grace_s=5.0)
    )
    backend = args.backend or ("bwrap" if args.smoke else "both")
    backends = ("docker", "bwrap") if backend == "both" else (backend,)
    from inference.tiny import build_tokenizer
    from workers.resources import loop_factory, raise_open_files_limit, tune_gc

    tune_gc()  # the ceiling's process runs as `python -m workers` does: GC and loop alike
    raise_open_files_limit()
    results = []
    with tempfile.TemporaryDirectory(prefix="bench-farm-") as tmp:
        model = Path(tmp) / "model"
        build_tokenizer().save_pretrained(model)
        for b in backends:
            with asyncio.Runner(loop_factory=loop_factory(LOOPS[b])) as runner:
                results.append(runner.run(run_backend(b, n, timing, tmp=Path(tmp), model=model)))
    return report.emit(run, results, table(results), args.json)
