"""Sandbox benchmark: tool-call round trip against `docker exec`, cold start, warm
acquire, and how many live sessions this machine holds (with memory per session).

    python -m bench sandbox [--quick] [--json] [--backend docker|bwrap] [--sessions N]

The round trip is `Session.run_python` of a trivial function, measured from the
caller (asyncio client, socket, agent, a fresh child with its limits, reply). It is
timed twice: with a 5 ms pause between calls (the agent pre-forks the next child
while the caller thinks, as an RL worker does while the model generates) and
back-to-back (the fork then lands on the round trip). The baseline is `docker exec`
of the same code in the same container, in the same run.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any

from bench import _report as report
from launch.settings import HelpFormatter
from sandbox import SandboxConfig, SandboxPool

CALL = "def f(x):\n    return x + 1\nprint(f(41))"
WHO = "import os\nprint(42, os.getuid(), os.getcwd(), os.environ['TMPDIR'])"
SOCKET_DIR = Path("/tmp/rf-sbx-bench")


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def mem_available_mb() -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no MemAvailable in /proc/meminfo")


def container_cpu_ns(container_id: str) -> int | None:
    """CPU time used by a container so far (cgroup v1 cpuacct or v2 cpu.stat)."""
    v1 = Path(f"/sys/fs/cgroup/cpuacct/docker/{container_id}/cpuacct.usage")
    if v1.exists():
        return int(v1.read_text())
    v2 = Path(f"/sys/fs/cgroup/system.slice/docker-{container_id}.scope/cpu.stat")
    if v2.exists():
        return int(v2.read_text().split()[1]) * 1000
    return None


async def round_trips(pool: SandboxPool, n: int, pause_s: float) -> tuple[list[float], dict]:
    """Round-trip times, plus the CPU each call cost on both sides of the socket."""
    times = []
    async with pool.session() as s:
        for _ in range(5):
            await s.run_python(CALL)
        native = s.sandbox.handle.native
        cid = getattr(native, "id", None)
        cpu0 = container_cpu_ns(cid) if cid else None
        client0 = time.process_time()
        for _ in range(n):
            if pause_s:
                await asyncio.sleep(pause_s)
            began = time.perf_counter()
            r = await s.run_python(CALL)
            times.append(time.perf_counter() - began)
            assert r.stdout == "42\n", r
        cpu = {"client_cpu_ms": (time.process_time() - client0) / n * 1e3}
        if cpu0 is not None:
            cpu["sandbox_cpu_ms"] = (container_cpu_ns(cid) - cpu0) / n / 1e6
    return times, cpu


def docker_exec_times(container_name: str, n: int) -> list[float]:
    """The peer baseline: `docker exec` of the same code, through the CLI."""
    times = []
    cmd = ["docker", "exec", "-w", "/work", container_name, "python3", "-c", CALL]
    for _ in range(n):
        began = time.perf_counter()
        out = subprocess.run(cmd, capture_output=True, check=True).stdout
        times.append(time.perf_counter() - began)
        assert out == b"42\n"
    return times


def docker_sdk_exec_times(container: Any, n: int) -> list[float]:
    """The same through the Docker SDK (exec create + start over the engine's API)."""
    times = []
    for _ in range(n):
        began = time.perf_counter()
        result = container.exec_run(["python3", "-c", CALL], workdir="/work")
        times.append(time.perf_counter() - began)
        assert result.output == b"42\n", result
    return times


async def acquire_times(pool: SandboxPool, n: int) -> list[float]:
    times = []
    for _ in range(n):
        began = time.perf_counter()
        session = await pool.acquire()
        times.append(time.perf_counter() - began)
        await pool.release(session)
    return times


async def cold_starts(config: SandboxConfig, n: int) -> list[float]:
    times = []
    async with SandboxPool(config.model_copy(update={"warm": 0})) as pool:
        for _ in range(n):
            began = time.perf_counter()
            async with pool.session() as s:
                times.append(time.perf_counter() - began)
                pool.taint(s, "benchmark: force a fresh sandbox")
    return times


async def live_sessions(config: SandboxConfig, n: int, per_sandbox: int) -> dict[str, Any]:
    jail = 1 if config.backend == "bwrap" else per_sandbox  # bwrap: a jail per session
    cfg = config.model_copy(
        update={
            "warm": 0,
            "sessions_per_sandbox": per_sandbox,
            "max_sandboxes": -(-n // jail),
            # a small memory cgroup per session (the sandbox's memory follows from them)
            "session_memory_mb": 32,
            "work_mb": 8,
            "pids": per_sandbox * 3 + 64,
        }
    )
    before = mem_available_mb()
    async with SandboxPool(cfg) as pool:
        sessions = []
        began = time.perf_counter()
        for _ in range(n):
            sessions.append(await pool.acquire())
        opened_s = time.perf_counter() - began
        sem = asyncio.Semaphore(64)

        async def call(s: Any) -> str:
            async with sem:
                return (await s.run_python(WHO)).stdout

        answers = await asyncio.gather(*(call(s) for s in sessions))
        ok = sum(a.startswith("42 ") for a in answers)
        # isolation is on: every live session answered as its own uid (own jail on bwrap)
        distinct = len({a for a in answers})
        await asyncio.sleep(1.0)  # let the standby forks settle before measuring
        used = before - mem_available_mb()
        sandboxes = len(pool._sandboxes)
        for s in sessions:
            await pool.release(s)
    return {
        "sessions": n,
        "answered": ok,
        "distinct_uids": distinct,
        "sandboxes": sandboxes,
        "open_s": opened_s,
        "mem_total_mb": used,
        "mem_per_session_mb": used / n,
    }


async def run(args: argparse.Namespace) -> dict[str, Any]:
    n_calls = 20 if args.smoke else 200 if args.quick else 1000
    config = SandboxConfig(
        backend=args.backend, warm=2, sessions_per_sandbox=16, socket_dir=SOCKET_DIR
    )
    out: dict[str, Any] = {"backend": args.backend}
    async with SandboxPool(config) as pool:
        out["load_avg_1m_start"] = os.getloadavg()[0]
        paused, cpu = await round_trips(pool, n_calls, 0.005)
        burst, _ = await round_trips(pool, n_calls, 0.0)
        out.update(cpu)
        acquire = await acquire_times(pool, 5 if args.smoke else 50 if args.quick else 300)
        if args.backend == "docker":
            n_exec = 3 if args.smoke else 10 if args.quick else 40
            async with pool.session() as s:
                name = s.sandbox.handle.name
                cli = await asyncio.to_thread(docker_exec_times, name, n_exec)
                sdk = await asyncio.to_thread(
                    docker_sdk_exec_times, s.sandbox.handle.native, n_exec
                )
            out["docker_exec_cli_p50_ms"] = statistics.median(cli) * 1e3
            out["docker_exec_sdk_p50_ms"] = statistics.median(sdk) * 1e3
            # the ratio is taken against the faster of the two peers
            exec_times = sdk if statistics.median(sdk) < statistics.median(cli) else cli
            out["docker_exec_p50_ms"] = statistics.median(exec_times) * 1e3
            out["docker_exec_p99_ms"] = pct(exec_times, 0.99) * 1e3
    out["rt_p50_ms"] = statistics.median(paused) * 1e3
    out["rt_p99_ms"] = pct(paused, 0.99) * 1e3
    out["rt_burst_p50_ms"] = statistics.median(burst) * 1e3
    out["rt_burst_p99_ms"] = pct(burst, 0.99) * 1e3
    if "docker_exec_p50_ms" in out:
        out["speedup_vs_exec"] = out["docker_exec_p50_ms"] / out["rt_p50_ms"]
        out["speedup_burst_vs_exec"] = out["docker_exec_p50_ms"] / out["rt_burst_p50_ms"]
    out["acquire_p50_ms"] = statistics.median(acquire) * 1e3
    out["acquire_p99_ms"] = pct(acquire, 0.99) * 1e3
    cold = await cold_starts(config, 1 if args.smoke else 3 if args.quick else 8)
    out["cold_start_p50_s"] = statistics.median(cold)
    n = args.sessions or (8 if args.smoke else 200 if args.quick else 1000)
    out["live"] = await live_sessions(config, n, 100)
    out["load_avg_1m_end"] = os.getloadavg()[0]
    return out


def table(r: dict[str, Any]) -> str:
    rows = [
        ("tool-call round trip p50 (5 ms think time)", f"{r['rt_p50_ms']:.2f} ms"),
        ("tool-call round trip p99 (5 ms think time)", f"{r['rt_p99_ms']:.2f} ms"),
        ("tool-call round trip p50 (back-to-back)", f"{r['rt_burst_p50_ms']:.2f} ms"),
        ("tool-call round trip p99 (back-to-back)", f"{r['rt_burst_p99_ms']:.2f} ms"),
    ]
    rows.append(("client CPU per call (asyncio, framing)", f"{r['client_cpu_ms']:.2f} ms"))
    if "sandbox_cpu_ms" in r:
        rows.append(("sandbox CPU per call (container cpuacct)", f"{r['sandbox_cpu_ms']:.2f} ms"))
    if "docker_exec_p50_ms" in r:
        rows += [
            (
                "docker exec p50, CLI (same call, same container)",
                f"{r['docker_exec_cli_p50_ms']:.1f} ms",
            ),
            ("docker exec p50, SDK exec_run", f"{r['docker_exec_sdk_p50_ms']:.1f} ms"),
            (
                "docker exec p50 / p99, faster of the two",
                f"{r['docker_exec_p50_ms']:.1f} / {r['docker_exec_p99_ms']:.1f} ms",
            ),
            ("speed-up vs docker exec (p50, think time)", f"{r['speedup_vs_exec']:.0f}x"),
            ("speed-up vs docker exec (p50, back-to-back)", f"{r['speedup_burst_vs_exec']:.0f}x"),
        ]
    live = r["live"]
    rows += [
        ("warm acquire p50 / p99", f"{r['acquire_p50_ms']:.2f} / {r['acquire_p99_ms']:.2f} ms"),
        ("cold sandbox start p50 (to first session)", f"{r['cold_start_p50_s'] * 1e3:.0f} ms"),
        ("live sessions held (answered a call)", f"{live['answered']} / {live['sessions']}"),
        ("distinct (uid, work dir, TMPDIR) among them", str(live["distinct_uids"])),
        ("sandboxes for them", str(live["sandboxes"])),
        ("time to open them", f"{live['open_s']:.1f} s"),
        ("host memory per live session", f"{live['mem_per_session_mb']:.2f} MiB"),
        (
            "host load average (1 min) at start / end",
            f"{r['load_avg_1m_start']:.1f} / {r['load_avg_1m_end']:.1f}",
        ),
    ]
    width = max(len(k) for k, _ in rows)
    lines = [f"sandbox benchmark ({r['backend']})", "-" * (width + 16)]
    lines += [f"{k:<{width}}  {v:>12}" for k, v in rows]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench sandbox", description=__doc__, formatter_class=HelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="under a minute")
    parser.add_argument("--smoke", action="store_true", help="the smallest counts (CI)")
    parser.add_argument("--json", action="store_true", help="print JSON (the table to stderr)")
    parser.add_argument("--backend", choices=["docker", "bwrap"], default="docker")
    parser.add_argument("--sessions", type=int, default=0, help="live sessions to hold")
    args = parser.parse_args(argv)
    started = report.start("sandbox", argv)
    if args.backend == "docker":
        from sandbox.image import build

        build(quiet=True)
    result = asyncio.run(run(args))
    return report.emit(started, result, table(result), args.json)
