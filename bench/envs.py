"""Environments benchmark: what the envs layer costs on top of its floor.

- toy: episodes per second through ``envs.areset``/``envs.astep`` against calling
  the environment's ``reset``/``step`` directly (the cost of the async driver).
- code: latency of one ``code`` step (compile check + 3 stdio tests = 4 sandbox
  runs) against 4 bare ``run_python`` calls in one session (the sandbox floor).
- codegym: latency of one tool call (runtime + state snapshot in, reply out)
  against one bare ``run_python`` call in the same kind of session.

Medians over the samples; the sandbox backend is bwrap unless ``--backend docker``.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from collections.abc import Awaitable, Callable
from typing import Any

import envs
from bench import _report as report
from envs.sandboxed import SandboxPool
from launch.settings import HelpFormatter

SUM_TWO = "a, b = map(int, input().split())\nprint(a + b)\n"


async def _median_s(samples: int, fn: Callable[[], Awaitable[Any]]) -> float:
    times = []
    for _ in range(samples):
        start = time.perf_counter()
        await fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


async def bench_toy(episodes: int) -> dict[str, Any]:
    env = envs.make("toy")

    async def driven() -> None:
        for seed in range(episodes):
            await envs.areset(env, seed=seed)
            await envs.astep(env, "3")

    def direct() -> None:
        for seed in range(episodes):
            env.reset(seed=seed)
            env.step("3")

    start = time.perf_counter()
    await driven()
    driven_s = time.perf_counter() - start
    start = time.perf_counter()
    direct()
    direct_s = time.perf_counter() - start
    return {
        "case": "toy episode",
        "unit": "episodes/s",
        "envs": episodes / driven_s,
        "floor": episodes / direct_s,
        "ratio": direct_s / driven_s,
    }


async def bench_code(pool: SandboxPool, samples: int) -> dict[str, Any]:
    env = envs.make('code@{"problem_ids": ["sum-two"]}', sandbox=pool)

    async def step() -> None:
        await envs.areset(env, seed=0)
        assert (await envs.astep(env, SUM_TWO))[1] == 1.0

    async def floor() -> None:
        async with pool.session() as sb:
            for _ in range(4):
                await sb.run_python(SUM_TWO, stdin="1 2\n")

    envs_s, floor_s = await _median_s(samples, step), await _median_s(samples, floor)
    return {
        "case": "code step (4 runs)",
        "unit": "ms",
        "envs": envs_s * 1e3,
        "floor": floor_s * 1e3,
        "ratio": floor_s / envs_s,
    }


async def bench_codegym(pool: SandboxPool, samples: int) -> dict[str, Any]:
    env = envs.make('codegym@{"env": "max_subarray", "config_index": 0}', sandbox=pool)
    action = '<tool_call>{"name": "GetElement", "arguments": {"index": 3}}</tool_call>'
    await envs.areset(env, seed=0)
    try:
        envs_s = await _median_s(samples, lambda: envs.astep(env, action))
    finally:
        await envs.aclose(env)
    async with pool.session() as sb:
        floor_s = await _median_s(samples, lambda: sb.run_python("print(4)"))
    return {
        "case": "codegym tool call",
        "unit": "ms",
        "envs": envs_s * 1e3,
        "floor": floor_s * 1e3,
        "ratio": floor_s / envs_s,
    }


async def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    import sandbox

    samples = 2 if args.smoke else 10 if args.quick else 50
    rows = [await bench_toy(100 if args.smoke else 2_000 if args.quick else 20_000)]
    async with sandbox.SandboxPool(sandbox.SandboxConfig(backend=args.backend)) as pool:
        rows.append(await bench_code(pool, samples))
        rows.append(await bench_codegym(pool, samples))
    return rows


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench envs",
        description=__doc__.splitlines()[0],
        formatter_class=HelpFormatter,
    )
    parser.add_argument("--quick", action="store_true", help="fewer samples (well under a minute)")
    parser.add_argument("--smoke", action="store_true", help="two samples a case (CI)")
    parser.add_argument("--json", action="store_true", help="print JSON (the table to stderr)")
    parser.add_argument(
        "--backend", default="bwrap", choices=["bwrap", "docker"], help="sandbox backend"
    )
    args = parser.parse_args(argv)
    started = report.start("envs", argv)
    rows = asyncio.run(run(args))
    return report.emit(started, rows, table(rows), args.json)


def table(rows: list[dict[str, Any]]) -> str:
    lines = [f"{'case':<22} {'unit':<12} {'envs':>10} {'floor':>10} {'envs/floor':>11}"]
    lines += [
        f"{r['case']:<22} {r['unit']:<12} {r['envs']:>10.2f} {r['floor']:>10.2f} {r['ratio']:>11.2f}"
        for r in rows
    ]
    lines.append(
        "(median; floor = bare env calls for toy, bare sandbox run_python calls otherwise;"
        " envs/floor = floor speed relative: 1.0 means no overhead)"
    )
    return "\n".join(lines)
