"""`python -m bench broker --cluster`: the broker on a local 3-master Redis Cluster.

One to three concurrent runs, each with three partitions (so each run's streams
spread over the masters), each with its own producer process (as a worker pod) and
consumer process (as a learner: read every partition, decode, commit per slot).
The ceiling in the same invocation: `redis-benchmark --cluster`, pipelined XADD of
a payload of the same size on all three masters at once, which does no consuming
or acking. The cluster is the tests' launcher
(tests/cluster.py: six Debian redis-server processes, 3 masters + 3 replicas).
"""

from __future__ import annotations

import asyncio
import multiprocessing
import statistics
import subprocess
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from bench._broker_groups import make_group
from broker.codec import encode
from broker.connection import RedisSettings, connect
from broker.consumer import Consumer, ConsumerConfig
from broker.keys import LEARNER_GROUP, RunKeys
from broker.memory import tune_malloc
from broker.messages import TrajectoryGroup
from broker.producer import Producer
from tests.cluster import LocalCluster
from workers.resources import loop_factory

PARTITIONS = 3


@dataclass
class ClusterRow:
    runs: int
    tokens: int
    entry_bytes: int
    entries: int  # per run
    farm_entries_s: float  # all runs together
    farm_mb_s: float
    raw_xadd_mb_s: float
    ratio: float
    masters_used: int  # distinct masters holding the runs' trajectories streams


async def _produce(url: str, run: str, tokens: int, count: int) -> None:
    redis = await connect(RedisSettings.from_url(url))
    keys = RunKeys(run, PARTITIONS)
    producer = Producer(redis)
    template = make_group(tokens, 0)
    for i in range(0, count, 8):
        groups = [replace(template, group_id=f"g{j}") for j in range(i, min(i + 8, count))]
        await producer.publish(keys.trajectories((i // 8) % PARTITIONS), groups)
    await redis.aclose()


async def _consume(url: str, run: str, count: int, read_count: int, pipe: Any) -> float:
    redis = await connect(RedisSettings.from_url(url))
    keys = RunKeys(run, PARTITIONS)
    cfg = ConsumerConfig(group=LEARNER_GROUP, consumer="bench", block_ms=100, count=read_count)
    consumer = Consumer(redis, keys, keys.all_trajectories, cfg, expect=TrajectoryGroup)
    await consumer.ensure_groups()
    await _start_together(pipe)
    started, got = time.perf_counter(), 0
    while got < count:
        deliveries = await consumer.read()
        await consumer.commit(deliveries)
        got += len(deliveries)
    elapsed = time.perf_counter() - started
    await redis.aclose()
    return elapsed


async def _start_together(pipe: Any) -> None:
    """Report ready, then sleep until the start time the parent sends to everyone."""
    pipe.send("ready")
    start_at = await asyncio.to_thread(pipe.recv)
    await asyncio.sleep(max(0.0, start_at - time.time()))


def _role(
    kind: str, url: str, run: str, tokens: int, counts: tuple[int, int], *, pipe: Any
) -> None:
    """One run's producer (a worker pod) or consumer (its learner), as a process;
    `counts`: (entries, entries per consumer read)."""
    count, read_count = counts
    tune_malloc()
    with asyncio.Runner(loop_factory=loop_factory("uvloop")) as runner:
        if kind == "consumer":
            pipe.send(runner.run(_consume(url, run, count, read_count, pipe)))
        else:
            runner.run(_start_together(pipe))
            runner.run(_produce(url, run, tokens, count))


def farm_pass(
    cluster: LocalCluster, runs: list[str], tokens: int, count: int, read_count: int
) -> float:
    """Entries/s of all runs together: every run's producer and consumer start at once."""
    ctx = multiprocessing.get_context("fork")  # the parent runs no event loop or thread here
    procs, pipes, consumers = [], [], []
    for run in runs:
        for kind in ("consumer", "producer"):
            mine, theirs = ctx.Pipe()
            args, kwargs = (kind, cluster.url, run, tokens, (count, read_count)), {"pipe": theirs}
            procs.append(ctx.Process(target=_role, args=args, kwargs=kwargs, name=f"{kind}-{run}"))
            pipes.append(mine)
            if kind == "consumer":
                consumers.append(mine)
    for p in procs:
        p.start()
    for pipe in pipes:
        if not pipe.poll(300) or pipe.recv() != "ready":
            raise RuntimeError("a benchmark process did not get ready")
    start_at = time.time() + 0.5
    for pipe in pipes:
        pipe.send(start_at)
    elapsed = []
    for pipe in consumers:
        if not pipe.poll(600):
            raise RuntimeError("a consumer did not finish")
        elapsed.append(pipe.recv())
    for p in procs:
        p.join(60)
        if p.exitcode != 0:
            raise RuntimeError(f"{p.name} exited with {p.exitcode}")
    return len(runs) * count / max(elapsed)


def raw_ceiling(cluster: LocalCluster, payload: bytes, requests: int) -> float:
    """MB/s of pipelined XADD on every master at once, as `redis-benchmark --cluster`
    measures it (its `{tag}` becomes a hash tag of each master's slots)."""
    payload = payload.replace(b"\x00", b"\x01")  # -x cuts at the first NUL: only size matters
    xadd = ["XADD", "{tag}:s", "MAXLEN", "~", "200", "*", "b"]
    options = ["-n", str(requests), "-c", "6", "-P", "8", "--csv", "-x"]
    cmd = ["redis-benchmark", "--cluster", "-p", str(cluster.ports[0]), *options, *xadd]
    out = subprocess.run(cmd, input=payload, capture_output=True, check=True, timeout=600).stdout
    rps = float(out.decode().strip().splitlines()[-1].split(",")[1].strip('"'))
    return rps * len(payload) / 1e6


def measure(
    cluster: LocalCluster, runs: int, tokens: int, count: int, repeats: int, *, read_count: int
) -> ClusterRow:
    names = [f"bench{i}" for i in range(runs)]
    payload = encode(make_group(tokens, 0))[b"b"]
    rates = []
    for _ in range(repeats):
        cluster.flush()
        rates.append(farm_pass(cluster, names, tokens, count, read_count))
    peak = statistics.median(rates)
    raw = statistics.median(raw_ceiling(cluster, payload, 3 * count) for _ in range(repeats))
    streams = [s for n in names for s in RunKeys(n, PARTITIONS).all_trajectories]
    masters = {cluster.master_of(s) for s in streams}
    mb = peak * len(payload) / 1e6
    return ClusterRow(runs, tokens, len(payload), count, peak, mb, raw, mb / raw, len(masters))


def table(rows: list[ClusterRow]) -> str:
    lines = [
        f"{'runs':>4} {'tokens/traj':>11} {'entry KB':>9} {'masters':>7} {'farm ent/s':>10} "
        f"{'farm MB/s':>9} {'raw XADD MB/s':>13} {'ratio':>6}"
    ]
    for r in rows:
        lines.append(
            f"{r.runs:>4} {r.tokens:>11} {r.entry_bytes / 1024:>9.1f} {r.masters_used:>7} "
            f"{r.farm_entries_s:>10.0f} {r.farm_mb_s:>9.1f} {r.raw_xadd_mb_s:>13.1f} {r.ratio:>6.2f}"
        )
    return "\n".join(lines)


def run_cluster_bench(quick: bool, read_count: int) -> list[ClusterRow]:
    """Start the cluster, measure 1 and 3 runs at 1k and 8k tokens, stop it."""
    plan = {1024: 1000, 8192: 200}
    if quick:
        plan = {k: v // 4 for k, v in plan.items()}
    repeats = 1 if quick else 3
    with tempfile.TemporaryDirectory() as tmp:
        cluster = LocalCluster(Path(tmp))
        try:
            cluster.start()
            return [
                measure(cluster, runs, t, n, repeats, read_count=read_count)
                for runs in (1, 3)
                for t, n in plan.items()
            ]
        finally:
            cluster.stop()


def report(quick: bool, read_count: int) -> tuple[list[dict[str, Any]], str]:
    """The cluster rows and their table (after the single-node table of `bench broker`)."""
    rows = run_cluster_bench(quick, read_count)
    repeats = 1 if quick else 3
    text = "\n".join(
        (
            f"\nbroker on a local Redis Cluster (3 masters, 3 replicas), {PARTITIONS} partitions"
            " a run",
            f"publish -> consume -> commit per slot; medians of {repeats}; ent/s summed over runs",
            table(rows),
            "raw XADD = redis-benchmark --cluster, pipelined XADD of the same payload on every",
            "master at once (no consume, no ack); masters = those holding the runs' partitions",
        )
    )
    return [asdict(r) for r in rows], text
