"""`python -m bench workers [--quick] [--json]`: the rollout workers' own costs and scaling.

Inference is a LATENCY-SIMULATING SERVER (`bench._loadgen`, a load generator in its own
process: it sleeps a log-normal latency and returns random tokens in the /v1/completions
shape); environments are `bench-sim`, which sleep a heavy-tailed latency per step and
run a heavy-tailed number of turns (seeded, so both loops see the same episodes). The
farm's code path is the real one: ChatCodec (tiny model's tokenizer and chat template),
GenerationClient over HTTP, envs.astep, run_episode.

1. CPU per env step: this process's CPU time / env steps (the load generator and the
   environments' sleeps cost nothing here), beside a bare aiohttp POST loop (baseline);
   the agent endpoint's CPU per chat call against a direct generate (an agent in the
   worker's process, through the in-process transport; and over HTTP); and an agent program
   in the sandbox (`bench._sandbox_agent`: bwrap, else Docker, else n/a): the worker's CPU
   per call and the latency it adds against the same agent in the worker's process.
2. N concurrent episodes in one process (10,000; 2,000 with --quick), closed loop:
   achieved vs ideal step throughput (Little's law: N / (mean inference + mean env
   latency)), event-loop lag p99, RSS growth per episode.
3. Synchronous batch-barrier loop (every turn waits for the slowest env and the batch
   for its longest episode, as in GEM / AgentGym-RL) vs this farm, same episodes.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import random
import statistics
import time
from contextlib import asynccontextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

import envs
from bench import _report as report
from bench._agent_endpoint import measure_endpoint_cpu
from bench._loadgen_proc import Server, loadgen_process, serving
from bench._sandbox_agent import measure_sandbox_agent
from broker.messages import Task
from envs import Env
from launch.settings import HelpFormatter
from workers.episode import EpisodeContext, EpisodeSettings, run_episode
from workers.lag import LagMonitor
from workers.resources import loop_factory, raise_open_files_limit, tune_gc


class SimEnv(Env):
    """Heavy-tailed turns (Pareto) and step latency (log-normal), seeded per episode;
    `env_ms=0` is an instant environment (the CPU phases: the env costs nothing there)."""

    steps_taken = 0  # every step of every instance, for throughput windows

    def __init__(self, env_ms: float = 20.0, sigma: float = 1.0, alpha: float = 1.3, cap: int = 32):
        self.instant = env_ms <= 0
        self.mu = 0.0 if self.instant else math.log(env_ms / 1000)
        self.sigma, self.alpha, self.cap = sigma, alpha, cap

    async def areset(self, *, seed: int | None = None) -> tuple[str, dict[str, Any]]:
        self.rng = random.Random(seed)
        self.turns = min(self.cap, math.ceil(self.rng.paretovariate(self.alpha)))
        self.k = 0
        return f"Episode {seed}: begin.", {}

    async def astep(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        if not self.instant:
            await asyncio.sleep(self.rng.lognormvariate(self.mu, self.sigma))
        self.k += 1
        SimEnv.steps_taken += 1
        return f"Observation {self.k}.", 0.0, self.k >= self.turns, False, {}


if "bench-sim" not in envs.registered():
    envs.register("bench-sim", SimEnv)


@asynccontextmanager
async def farm_context(url: str, pool: int | None = None):
    """The farm's real episode context; `pool` sets the client's connection limit."""
    from inference.client import GenerationClient, SamplingParams
    from inference.config import ClientConfig
    from inference.tiny import build_tokenizer
    from workers.tokens import ChatCodec

    limits = {} if pool is None else {"max_connections": pool}
    async with GenerationClient([url], ClientConfig(request_timeout_s=120, **limits)) as client:
        yield EpisodeContext(
            codec=ChatCodec(build_tokenizer()), client=client, sampling=SamplingParams
        )


SETTINGS = EpisodeSettings(max_tokens=8, max_context_tokens=4096, episode_timeout_s=3600)


def _task(seed: int, spec: str) -> Task:
    return Task(f"b{seed}", spec, group_size=1, seed=seed, policy_version=0)


async def run_async(ctx: EpisodeContext, spec: str, seeds: list[int], concurrency: int) -> int:
    """This farm: each episode proceeds on its own; a free slot takes the next episode.

    Slots are `concurrency` lanes pulling from one queue of seeds, as the worker reads a
    task only for a free slot (a semaphore with every episode waiting on it would charge
    its O(waiters) wake-ups to the farm).
    """
    pending = iter(seeds)
    steps = 0

    async def lane() -> None:
        nonlocal steps
        for seed in pending:
            traj = await run_episode(ctx, SETTINGS, _task(seed, spec), 0, max_turns=64)
            assert traj.error.value == "none", traj.error_detail
            steps += len(traj.turns)

    async with asyncio.TaskGroup() as tg:
        for k in range(min(concurrency, len(seeds))):
            tg.create_task(lane(), name=f"lane:{k}")
    return steps


async def run_sync(ctx: EpisodeContext, spec: str, seeds: list[int], batch: int) -> int:
    """Batch-barrier loop: generate for all, step all, wait for the slowest; a batch ends
    when its longest episode does (GEM / AgentGym-RL style)."""
    from inference.client import SamplingParams

    params = SamplingParams(max_tokens=8, stop_token_ids=tuple(ctx.codec.stop_token_ids))
    steps = 0
    for start in range(0, len(seeds), batch):
        group = [envs.make(spec) for _ in seeds[start : start + batch]]
        resets = await asyncio.gather(
            *(envs.areset(e, seed=s) for e, s in zip(group, seeds[start:], strict=False))
        )
        context = [ctx.codec.initial_prompt(obs, None, None) for obs, _ in resets]
        active = list(range(len(group)))
        while active:
            gens = await asyncio.gather(
                *(ctx.client.generate(context[i], params, session_id=f"s{i}") for i in active)
            )
            actions = [ctx.codec.decode(g.token_ids) for g in gens]
            results = await asyncio.gather(
                *(envs.astep(group[i], a) for i, a in zip(active, actions, strict=True))
            )
            still = []
            for i, gen, (obs, _, done, trunc, _) in zip(active, gens, results, strict=True):
                steps += 1
                if not (done or trunc):
                    context[i] += [*gen.token_ids, *ctx.codec.next_prompt(gen.token_ids, obs)]
                    still.append(i)
            active = still
    return steps


def _rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


CPU_LOADGEN = (5.0, 0.3)  # the CPU phase's load generator: median ms, sigma (fast: farm CPU shows)
SIGMA = 0.3  # of the scale phases' load generator


async def measure_cpu_per_step(
    episodes: int, rounds: int, shared: Server | None = None
) -> dict[str, float]:
    """Farm CPU per env step (fast loadgen and env, so the farm's own work dominates),
    and the bare-POST baseline; medians over `rounds` rounds, as this machine is noisy."""
    spec = 'bench-sim@{"env_ms": 0, "alpha": 1.3, "cap": 16}'
    farm, rates, bare = [], [], []
    async with serving(shared, *CPU_LOADGEN) as url, farm_context(url) as ctx:
        await run_async(ctx, spec, list(range(64)), 64)  # warm-up: caches, connections
        for r in range(rounds):
            seeds = list(range(1000 + r * episodes, 1000 + (r + 1) * episodes))
            cpu0, t0 = time.process_time(), time.perf_counter()
            steps = await run_async(ctx, spec, seeds, 256)
            cpu, wall = time.process_time() - cpu0, time.perf_counter() - t0
            farm.append(cpu / steps * 1e6)
            rates.append(steps / wall)
            bare.append(await _bare_post_cpu(url, steps, 256))
        calls = await measure_endpoint_cpu(ctx, episodes, rounds)
    return calls | {
        "rounds": rounds,
        "episodes_per_round": episodes,
        "cpu_us_per_step": statistics.median(farm),
        "steps_per_s": statistics.median(rates),
        "bare_post_cpu_us": statistics.median(bare),
    }


class InstantGenerator:
    """No HTTP at all: returns 7 random bytes and a stop token at once. Used only to split
    the farm's CPU per step into the episode loop's share and the HTTP client's. The
    completions are drawn up front: drawing 7 bytes with `random` per call cost ~10 µs,
    which the row charged to the episode loop."""

    def __init__(self, stop: int, pool: int = 4096) -> None:
        rng = random.Random(0)
        self.ids = [[*(rng.randrange(32, 127) for _ in range(7)), stop] for _ in range(pool)]
        self.calls = 0

    async def generate(self, prompt_ids: Any, params: Any, *, session_id: str) -> Any:
        from inference.client import Generation

        self.calls += 1
        ids = self.ids[self.calls % len(self.ids)]
        return Generation(ids, [-1.0] * 8, [0] * 8, "stop", "instant")

    def end_session(self, session_id: str) -> None:
        """No sticky servers to forget."""


async def measure_loop_only_cpu(episodes: int) -> float:
    """CPU per step of the episode loop alone (codec, env API, bookkeeping, metrics)."""
    spec = 'bench-sim@{"env_ms": 0, "alpha": 1.3, "cap": 16}'
    async with farm_context("http://127.0.0.1:9") as real:
        ctx = EpisodeContext(
            codec=real.codec,
            client=InstantGenerator(real.codec.stop_token_ids[0]),
            sampling=real.sampling,
        )
        await run_async(ctx, spec, list(range(64)), 64)
        cpu0 = time.process_time()
        steps = await run_async(ctx, spec, list(range(1000, 1000 + episodes)), 256)
        return (time.process_time() - cpu0) / steps * 1e6


async def _bare_post_cpu(url: str, n: int, concurrency: int) -> float:
    """Baseline: CPU per bare aiohttp POST /v1/completions to the same server."""
    import aiohttp

    body = {"prompt": [1, 2, 3], "max_tokens": 8, "stop_token_ids": [258], "logprobs": 1}
    slots = asyncio.Semaphore(concurrency)
    async with aiohttp.ClientSession() as session:

        async def one() -> None:
            async with slots, session.post(url + "/v1/completions", json=body) as resp:
                await resp.json()

        cpu0 = time.process_time()
        async with asyncio.TaskGroup() as tg:
            for i in range(n):
                tg.create_task(one(), name=f"post:{i}")
        return (time.process_time() - cpu0) / n * 1e6


async def measure_concurrency(
    n: int,
    window_s: float,
    pool: int | None,
    inf_ms: float = 4000.0,
    env_ms: float = 2000.0,
    *,
    shared: Server | None = None,
) -> dict[str, float]:
    """N episodes always in flight; steady-state throughput vs Little's-law ideal."""
    sigma = SIGMA
    spec = f'bench-sim@{{"env_ms": {env_ms}, "sigma": {sigma}, "alpha": 1.3, "cap": 32}}'
    mean = (inf_ms + env_ms) / 1000 * math.exp(sigma**2 / 2)
    lag = LagMonitor()
    async with serving(shared, inf_ms, sigma) as url, farm_context(url, pool) as ctx:
        rss0 = _rss_bytes()
        done = False

        async def lane(k: int) -> None:
            # Ramp up over one mean step: 10,000 simultaneous connects overflow the
            # server's accept backlog and the client marks the server unhealthy.
            await asyncio.sleep(k / n * mean)
            seed = k
            while not done:
                await run_episode(ctx, SETTINGS, _task(seed, spec), 0, max_turns=64)
                seed += n

        async with asyncio.TaskGroup() as tg:
            monitor = tg.create_task(lag.run(), name="lag")
            lanes = [tg.create_task(lane(k), name=f"lane:{k}") for k in range(n)]
            await asyncio.sleep(3 * mean)  # ramp-up and warm-up: every lane past its first step
            lag.samples.clear()
            steps0, cpu0, t0, rss = SimEnv.steps_taken, time.process_time(), time.monotonic(), 0
            while time.monotonic() < t0 + window_s:
                await asyncio.sleep(1.0)
                rss = max(rss, _rss_bytes())
            steps, wall = SimEnv.steps_taken - steps0, time.monotonic() - t0
            cpu = time.process_time() - cpu0
            done = True
            for task in [monitor, *lanes]:
                task.cancel()
    return {
        "episodes": n,
        "pool": pool or _default_pool(),
        "achieved_steps_per_s": steps / wall,
        "ideal_steps_per_s": n / mean,
        "lag_p50_ms": lag.percentile(0.5) * 1e3,
        "lag_p99_ms": lag.percentile(0.99) * 1e3,
        "rss_per_episode_kb": (rss - rss0) / n / 1024,
        "cpu_us_per_step": cpu / max(steps, 1) * 1e6,
    }


async def measure_sync_vs_async(
    episodes: int, batch: int, latency_ms: float, shared: Server | None = None
) -> dict[str, float]:
    """Latency-bound on purpose (CPU well below one core), so the ratio shows the loops'
    shape rather than this machine's CPU."""
    spec = f'bench-sim@{{"env_ms": {latency_ms}, "sigma": 1.0, "alpha": 1.3, "cap": 16}}'
    seeds = list(range(50_000, 50_000 + episodes))
    async with serving(shared, latency_ms, SIGMA) as url, farm_context(url) as ctx:
        t0 = time.perf_counter()
        sync_steps = await run_sync(ctx, spec, seeds, batch)
        sync_wall = time.perf_counter() - t0
        t0 = time.perf_counter()
        async_steps = await run_async(ctx, spec, seeds, batch)
        async_wall = time.perf_counter() - t0
    assert sync_steps == async_steps  # the same episodes, turn for turn
    return {
        "episodes": episodes,
        "concurrency": batch,
        "steps": async_steps,
        "latency_ms": latency_ms,
        "sync_steps_per_s": sync_steps / sync_wall,
        "async_steps_per_s": async_steps / async_wall,
        "ratio": (async_steps / async_wall) / (sync_steps / sync_wall),
    }


def _default_pool() -> int:
    from inference.config import ClientConfig

    return ClientConfig().max_connections


def _conc_rows(c: dict, label: str) -> list[tuple[str, str, str, str]]:
    share = c["achieved_steps_per_s"] / c["ideal_steps_per_s"]
    return [
        (
            f"{c['episodes']} episodes, {label}",
            f"{c['achieved_steps_per_s']:.0f} steps/s",
            "",
            f"ideal {c['ideal_steps_per_s']:.0f} steps/s ({share:.0%} of ideal)",
        ),
        (
            "  event-loop lag p50 / p99",
            f"{c['lag_p50_ms']:.1f} / {c['lag_p99_ms']:.1f} ms",
            "p99 <= 50 ms",
            "",
        ),
        ("  memory per episode (RSS growth)", f"{c['rss_per_episode_kb']:.1f} KiB", "", ""),
        ("  farm CPU per step at this load", f"{c['cpu_us_per_step']:.0f} us", "", ""),
    ]


def _sandbox_rows(sbx: dict | None) -> list[tuple[str, str, str, str]]:
    if sbx is None:
        return [("agent program in the sandbox", "n/a", "", "no bwrap and no Docker engine")]
    return [
        (
            f"agent program in the sandbox ({sbx['backend']}): worker CPU per call",
            f"{sbx['worker_cpu_us_per_call']:.0f} us",
            "",
            f"in-process agent (its client included): {sbx['in_process_cpu_us_per_call']:.0f} us",
        ),
        (
            "  latency per call (sequential)",
            f"{sbx['p50_ms']:.2f} ms",
            "",
            f"in-process agent: {sbx['in_process_p50_ms']:.2f} ms "
            f"({sbx['p50_ms'] - sbx['in_process_p50_ms']:+.2f} ms: relay and bridge)",
        ),
    ]


def _table(cpu: dict, loop: str, capped: dict, conc: dict, cmp: dict, *, sbx: dict | None) -> str:
    main = cpu[loop]
    other = [name for name in cpu if name != loop]
    rows = [
        (
            f"farm CPU per env step ({loop} loop)",
            f"{main['cpu_us_per_step']:.0f} us",
            "<= 150 us",
            f"bare aiohttp POST: {main['bare_post_cpu_us']:.0f} us "
            f"(ratio {main['cpu_us_per_step'] / main['bare_post_cpu_us']:.2f}x)",
        ),
        *(
            (
                f"  on the {name} loop",
                f"{cpu[name]['cpu_us_per_step']:.0f} us",
                "",
                f"bare aiohttp POST: {cpu[name]['bare_post_cpu_us']:.0f} us",
            )
            for name in other
        ),
        (
            "  of which the episode loop alone",
            f"{main['loop_only_cpu_us']:.0f} us",
            "",
            "codec, env API, bookkeeping, metrics; no HTTP (instant in-process generator)",
        ),
        (
            "agent endpoint CPU per chat call (in-process)",
            f"{main['endpoint_cpu_us_per_call']:.0f} us",
            "<= 1.5x generate",
            f"direct generate: {main['generate_cpu_us_per_call']:.0f} us (ratio "
            f"{main['endpoint_cpu_us_per_call'] / main['generate_cpu_us_per_call']:.2f}x)",
        ),
        (
            "  with a 32-message history",
            f"{main['endpoint_long_cpu_us_per_call']:.0f} us",
            "",
            "what a tool-using agent sends after 10 rounds (ratio "
            f"{main['endpoint_long_cpu_us_per_call'] / main['generate_cpu_us_per_call']:.2f}x)",
        ),
        (
            "  over HTTP (an aiohttp client, TCP)",
            f"{main['endpoint_http_cpu_us_per_call']:.0f} us",
            "",
            "an agent with its own HTTP client; the in-process agent skips this hop (ratio "
            f"{main['endpoint_http_cpu_us_per_call'] / main['generate_cpu_us_per_call']:.2f}x)",
        ),
        *_sandbox_rows(sbx),
        *_conc_rows(capped, f"client default pool ({capped['pool']} conns)"),
        *_conc_rows(conc, f"client pool {conc['pool']} (one per episode)"),
        (
            f"sync batch-barrier loop ({cmp['episodes']} episodes, batch {cmp['concurrency']})",
            f"{cmp['sync_steps_per_s']:.0f} steps/s",
            "",
            "GEM / AgentGym-RL style",
        ),
        (
            "this farm (same episodes, same concurrency)",
            f"{cmp['async_steps_per_s']:.0f} steps/s",
            ">= 2.5x sync",
            f"ratio {cmp['ratio']:.2f}x",
        ),
    ]
    width = [max(len(r[i]) for r in rows) for i in range(4)]
    lines = ["inference: latency-simulating server (workers.loadgen, a load generator)"]
    for r in (("measure", "value", "target", "baseline / note"), *rows):
        lines.append("  ".join(c.ljust(w) for c, w in zip(r, width, strict=True)).rstrip())
    return "\n".join(lines)


@dataclass(frozen=True)
class Sizes:
    """One mode's sizes: full, `--quick` or `--smoke`."""

    episodes: int  # concurrent episodes of the scale phase (unless --episodes)
    cpu_episodes: int  # episodes per round of the CPU-per-step phase
    cpu_rounds: int  # its rounds (median)
    loop_only_episodes: int  # episodes of the bare-loop CPU row
    window_s: float  # steady-state window of the scale phase
    latency_ms: tuple[float, float]  # simulated inference and env step medians
    sync_vs_async: tuple[int, int, float]  # episodes, batch, latency ms
    sandbox_calls: int = 200  # sequential calls of the sandboxed and the in-process agent
    # Every phase against one load generator (CPU_LOADGEN's latency, so the phases' must be
    # the same) started once for the run, instead of one per phase: a start-up is seconds.
    one_server: bool = False


SIZES = {
    "full": Sizes(10_000, 1000, 5, 3000, 30.0, (4000.0, 2000.0), (512, 128, 100.0), 1000),
    "quick": Sizes(2000, 300, 3, 500, 5.0, (1000.0, 500.0), (128, 64, 50.0), 200),
    "smoke": Sizes(50, 50, 1, 50, 1.0, (5.0, 50.0), (16, 8, 5.0), 10, one_server=True),
}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench workers", description=__doc__, formatter_class=HelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="smaller run, under a minute")
    parser.add_argument("--smoke", action="store_true", help="the smallest sizes (CI)")
    parser.add_argument("--json", action="store_true", help="print JSON (the table to stderr)")
    parser.add_argument("--episodes", type=int, default=None, help="concurrent episodes (phase 2)")
    parser.add_argument(
        "--loop",
        choices=("uvloop", "asyncio"),
        default="uvloop",
        help="event loop of the farm (the worker's --event-loop; default uvloop)",
    )
    args = parser.parse_args(argv)
    run = report.start("workers", argv)
    size = SIZES["smoke" if args.smoke else "quick" if args.quick else "full"]
    n = args.episodes or size.episodes
    tune_gc()  # as python -m workers does
    raise_open_files_limit()  # as python -m workers does: a connection per episode

    async def cpu_phase(shared: Server | None) -> dict[str, float]:
        cpu = await measure_cpu_per_step(size.cpu_episodes, size.cpu_rounds, shared)
        cpu["loop_only_cpu_us"] = await measure_loop_only_cpu(size.loop_only_episodes)
        return cpu

    async def scale_phase(shared: Server | None) -> dict[str, Any]:
        capped = await measure_concurrency(n, size.window_s, None, *size.latency_ms, shared=shared)
        conc = await measure_concurrency(n, size.window_s, n, *size.latency_ms, shared=shared)
        cmp = await measure_sync_vs_async(*size.sync_vs_async, shared)
        return {"concurrency_client_default": capped, "concurrency": conc, "sync_vs_async": cmp}

    async def sandbox_phase(shared: Server | None) -> dict[str, Any]:
        async with serving(shared, *CPU_LOADGEN) as url, farm_context(url) as ctx:
            return await measure_sandbox_agent(ctx, size.sandbox_calls)

    def on_loop(name: str, phase: Any, shared: Server | None) -> Any:
        with asyncio.Runner(loop_factory=loop_factory(name)) as runner:
            return runner.run(phase(shared))

    loops = (args.loop, *(name for name in ("uvloop", "asyncio") if name != args.loop))
    result = {"load_generator": "workers.loadgen (latency-simulating server)", "loop": args.loop}
    with loadgen_process(*CPU_LOADGEN) if size.one_server else nullcontext() as shared:
        result["cpu"] = {name: on_loop(name, cpu_phase, shared) for name in loops}
        result |= on_loop(args.loop, sandbox_phase, shared)
        result |= on_loop(args.loop, scale_phase, shared)
    text = _table(
        result["cpu"],
        args.loop,
        result["concurrency_client_default"],
        result["concurrency"],
        result["sync_vs_async"],
        sbx=result["sandbox_agent"],
    )
    return report.emit(run, result, text, args.json)
