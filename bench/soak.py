"""`python -m bench soak [--minutes N] [--smoke] [--json]`: the farm for an hour; does it stay healthy?

`farm up` (private Redis, the CPU policy server, two workers, the learner) on a task that
keeps training: `toy@{"difficulty": 3}` (the last digit of a*b+c), which the tiny model
does not solve within an hour, so most groups have variance and the learner steps all
along (the digit-copy toy is solved in minutes, after which nearly every batch is
skipped). One completion token a sample, 16 groups of 8 a step.

Sampled every `--sample-s` (`bench._soak_probe`): each process's resident memory and
open file descriptors; Redis's used memory split into parts (every key's bytes by kind,
Redis's overhead and client buffers) and the admission hold; the work directory on disk;
the books (every task issued accounted for). After `--warmup-min` the table gives, per
process, the least-squares RSS slope (MiB/h, and %/h of the fitted RSS at the end of
warm-up); the same for Redis's used memory, with and without the seen sets, and per part;
the largest stream against `--stream-max-bytes`; the reward by tenth of the run; the tasks
lost. The JSON envelope keeps Redis's time series. Goals: every process under 10 %/h after
warm-up; Redis, whose size follows what is in flight, judged by its own goal: used memory
less the seen sets flat (under 10 %/h) and every stream within its budget; nothing lost.

The seen sets (dedup ids, ~120 B each) grow for `--seen-ttl-s` before they level off:
the soak runs with 900 s (the default is a day: docs/deploy.md, "Redis sizing") so that
they level off inside the warm-up. Once levelled off, their size is the commit rate times
the TTL (about 120 bytes an id): the table gives their ids and bytes per id, so a growth
of theirs can be told from a leak.
`--smoke` (CI, tests/bench) runs 15 seconds with a 5-second warm-up and 1.5-second samples:
it shows the soak runs and the learner trims, not a slope.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import redis

from bench import _report as report
from bench._loadgen_proc import free_port
from bench._soak_probe import books, disk_mib, processes, redis_probe
from broker.keys import RunKeys
from launch.settings import HelpFormatter

ROOT = Path(__file__).resolve().parents[1]
RUN = "soak"
ENV_SPEC = 'toy@{"difficulty": 3}'


def farm_argv(work: Path, model: Path, port: int, args: argparse.Namespace) -> list[str]:
    learner = [
        "--group-size=8",
        "--groups-per-batch=16",
        "--learning-rate=1e-3",
        f"--stream-max-bytes={args.stream_max_bytes}",
        f"--seen-ttl-s={args.seen_ttl_s}",
    ]
    worker = ["--max-tokens=1", f"--seen-ttl-s={args.seen_ttl_s}"]
    return [
        *(sys.executable, "-m", "farm", "up", "--work-dir", str(work), "--model", str(model)),
        *("--metrics-port", "0", "--quiet", "--redis-port", str(port), "--run", RUN),
        *("--env-spec", ENV_SPEC, "--workers", "2"),
        *(f"--learner-arg={a}" for a in learner),
        *(f"--worker-arg={a}" for a in worker),
    ]


class Events:
    """The learner's step and skipped lines, read as the log grows."""

    def __init__(self, log: Path) -> None:
        self.log, self.offset = log, 0
        self.rows: list[dict[str, Any]] = []  # event, step, reward_mean, t (monotonic)
        self.warnings: list[str] = []

    def read(self) -> None:
        if not self.log.is_file():
            return
        with self.log.open("rb") as fh:
            fh.seek(self.offset)
            chunk = fh.read()
        end = chunk.rfind(b"\n") + 1
        self.offset += end
        now = time.monotonic()
        for line in chunk[:end].decode(errors="replace").splitlines():
            if " WARNING " in line and ("collapse" in line or "admission backs off" in line):
                self.warnings.append(line[:300])
            start = line.find('{"event": ')
            if start < 0:
                continue
            try:
                event = json.loads(line[start:])
            except ValueError:
                continue
            if event.get("event") in ("step", "skipped"):
                self.rows.append({**event, "t": now})


def _slope(points: list[tuple[float, float]]) -> tuple[float, float, float]:
    """(MiB/h, %/h, fitted MiB at the first point) of a least-squares line through (s, MiB)."""
    if len(points) < 3:
        return 0.0, 0.0, points[0][1] if points else 0.0
    t, y = np.array(points).T
    per_s, at0 = np.polyfit(t - t[0], y, 1)
    per_h = float(per_s) * 3600
    return per_h, 100 * per_h / max(float(at0), 1e-9), float(at0)


def sample(root: int, client: redis.Redis, keys: RunKeys, t0: float, work: Path) -> dict[str, Any]:
    return {
        "t": time.monotonic() - t0,
        "disk_mib": disk_mib(work),
        "procs": [p.__dict__ for p in processes(root)],
        "redis": redis_probe(client, keys),
        "books": books(client, keys),
    }


def run(model: Path, work: Path, args: argparse.Namespace) -> dict[str, Any]:
    port, keys = free_port(), RunKeys(RUN)
    events = Events(work / "logs" / "learner.log")
    out = (work.parent / "farm.out").open("wb")
    proc = subprocess.Popen(
        farm_argv(work, model, port, args),
        cwd=ROOT,
        stdout=out,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    samples: list[dict[str, Any]] = []
    try:
        deadline = time.monotonic() + args.start_budget_s
        while not events.rows:  # the clock starts at the learner's first batch
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(
                    f"farm did not start: {(work.parent / 'farm.out').read_text()[-3000:]}"
                )
            time.sleep(1.0)
            events.read()
        client = redis.Redis(port=port)
        t0 = time.monotonic()
        end = t0 + args.minutes * 60
        while time.monotonic() < end:
            if proc.poll() is not None:
                raise RuntimeError(f"farm exited: {(work.parent / 'farm.out').read_text()[-3000:]}")
            samples.append(sample(proc.pid, client, keys, t0, work))
            events.read()
            time.sleep(max(0.0, min(args.sample_s, end - time.monotonic())))
        samples.append(sample(proc.pid, client, keys, t0, work))
        events.read()
        client.close()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(120)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
        out.close()
    return summarize(samples, events, t0, args)


def _process_rows(samples: list[dict[str, Any]], warm: float) -> list[dict[str, Any]]:
    roles = sorted({p["role"] for s in samples for p in s["procs"]})
    rows = []
    for role in roles:
        seen = [(s["t"], p) for s in samples for p in s["procs"] if p["role"] == role]
        after = [(t, p["rss_mib"]) for t, p in seen if t >= warm]
        per_h, pct, at_warm = _slope(after)
        fds = [p["fds"] for _, p in seen]
        rows.append(
            {
                "role": role,
                "pids": len({p["pid"] for _, p in seen}),  # > 1: restarted
                "rss_warm_mib": round(at_warm, 1),
                "rss_end_mib": round(seen[-1][1]["rss_mib"], 1),
                "mib_per_h": round(per_h, 2),
                "pct_per_h": round(pct, 2),
                "fds": [fds[0], fds[-1], max(fds)],
            }
        )
    return rows


def _rewards(events: Events, t0: float, seconds: float, parts: int = 10) -> list[float | None]:
    buckets: list[list[float]] = [[] for _ in range(parts)]
    for row in events.rows:
        k = int((row["t"] - t0) / seconds * parts)
        if 0 <= k < parts:
            buckets[k].append(float(row["reward_mean"]))
    return [round(float(np.mean(b)), 3) if b else None for b in buckets]


# Parts of Redis's used memory the soak attributes a growth to (MiB, per sample).
PARTS = ("streams", "events", "seen", "other_keys", "overhead", "clients")


def _series(samples: list[dict[str, Any]]) -> list[dict[str, float]]:
    """Redis per sample: used and resident memory, each part, what no part explains (the
    dataset that MEMORY USAGE's estimates of the keys leave out), and the seen sets' ids
    (the commits of the last `--seen-ttl-s`)."""
    rows = []
    for s in samples:
        r = s["redis"]
        parts = {
            "streams": r["streams_mib"] - r["events_mib"],
            "events": r["events_mib"],
            "seen": r["seen_mib"],
            "other_keys": r["other_keys_mib"],
            "overhead": r["overhead_mib"],
            "clients": r["clients_mib"],
        }
        row = {"t_min": s["t"] / 60, "used": r["used_mib"], "rss": r["rss_mib"], **parts}
        row["unattributed"] = r["used_mib"] - sum(parts.values())
        row["seen_ids"] = r["seen_ids"]
        rows.append({k: round(v, 4) for k, v in row.items()})
    return rows


def _redis(samples: list[dict[str, Any]], warm: float, args: argparse.Namespace) -> dict[str, Any]:
    series = _series(samples)
    after = [row for row in series if row["t_min"] * 60 >= warm]

    def fit(name: str) -> tuple[float, float, float]:
        return _slope([(row["t_min"] * 60, row[name]) for row in after])

    per_h, pct, at_warm = fit("used")
    less_seen = _slope([(row["t_min"] * 60, row["used"] - row["seen"]) for row in after])
    per_id = [1e6 * row["seen"] / row["seen_ids"] for row in after if row["seen_ids"]]
    last = samples[-1]["redis"]
    return {
        "used_warm_mib": round(at_warm, 2),
        "used_end_mib": round(last["used_mib"], 2),
        "rss_end_mib": round(last["rss_mib"], 2),
        "mib_per_h": round(per_h, 2),
        "pct_per_h": round(pct, 2),
        "less_seen_mib_per_h": round(less_seen[0], 2),
        "less_seen_pct_per_h": round(less_seen[1], 2),
        "parts_mib_per_h": {k: round(fit(k)[0], 2) for k in (*PARTS, "unattributed")},
        "parts_end_mib": {k: series[-1][k] for k in (*PARTS, "unattributed")},
        "seen_ids_warm_end": [after[0]["seen_ids"], after[-1]["seen_ids"]] if after else [0, 0],
        "seen_bytes_per_id": [round(min(per_id)), round(max(per_id))] if per_id else [0, 0],
        "largest_stream_mib": round(max(s["redis"]["largest_stream_mib"] for s in samples), 3),
        "stream_budget_mib": round(args.stream_max_bytes / (1 << 20), 3),
        "streams_end_mib": round(last["streams_mib"], 3),
        "seen_end_mib": round(last["seen_mib"], 3),
        "held_share": round(float(np.mean([s["redis"]["held"] for s in samples])), 3),
        "trimmed_entries": last["entries"][0] - last["entries"][1],
        "held_entries": last["entries"][1],
        "series": series,
    }


def summarize(
    samples: list[dict[str, Any]], events: Events, t0: float, args: argparse.Namespace
) -> dict[str, Any]:
    warm = args.warmup_min * 60
    procs = _process_rows(samples, warm)
    redis_ = _redis(samples, warm, args)
    lost = [s["books"]["lost"] for s in samples]
    disk = [(s["t"], s["disk_mib"]) for s in samples if s["t"] >= warm]
    disk_per_h, _, disk_warm = _slope(disk)
    last = samples[-1]
    steps = [r for r in events.rows if r["event"] == "step"]
    return {
        "minutes": args.minutes,
        "warmup_min": args.warmup_min,
        "samples": len(samples),
        "processes": procs,
        "redis": redis_,
        "disk": {
            "warm_mib": round(disk_warm, 1),
            "end_mib": round(last["disk_mib"], 1),
            "mib_per_h": round(disk_per_h, 1),
        },
        "books": {
            **last["books"],
            "worst_lost": max((x for x in lost if x is not None), default=None),
        },
        "learner": {
            "steps": len(steps),
            "skipped": len(events.rows) - len(steps),
            "last_step": steps[-1]["step"] if steps else 0,
            "rewards": _rewards(events, t0, args.minutes * 60),
            "warnings": events.warnings[:5],
        },
        "goals": {
            # Redis is judged by its own goal below: a process that holds what is in flight
            # grows with it until its budget, so its RSS slope is not a leak by itself.
            "processes_under_10_pct_per_h": all(
                p["pct_per_h"] < 10 and p["pids"] == 1 for p in procs if p["role"] != "redis"
            ),
            # The seen sets hold the ids of the last `--seen-ttl-s` of commits, so they
            # follow the commit rate (bounded by the farm's throughput); the rest must be flat.
            "redis_flat_within_budget": redis_["less_seen_pct_per_h"] < 10
            and redis_["largest_stream_mib"] <= redis_["stream_budget_mib"],
            "nothing_lost": all(x == 0 for x in lost),
        },
    }


def table(result: dict[str, Any]) -> str:
    r, b, lr, d = result["redis"], result["books"], result["learner"], result["disk"]
    lines = [
        f"soak: {result['minutes']} min of `farm up` on {ENV_SPEC} (2 workers, 16 groups of 8 "
        f"a step), {result['samples']} samples; slopes after {result['warmup_min']} min warm-up",
        f"{'process':<16} {'RSS warm MiB':>12} {'RSS end MiB':>11} {'MiB/h':>8} {'%/h':>7} "
        f"{'fds start/end/max':>18}",
    ]
    for p in result["processes"]:
        fds = "/".join(str(x) for x in p["fds"])
        restarted = "  (restarted)" if p["pids"] > 1 else ""
        lines.append(
            f"{p['role']:<16} {p['rss_warm_mib']:>12.1f} {p['rss_end_mib']:>11.1f} "
            f"{p['mib_per_h']:>8.2f} {p['pct_per_h']:>7.2f} {fds:>18}{restarted}"
        )
    parts = ", ".join(f"{k} {v:+.2f}" for k, v in r["parts_mib_per_h"].items())
    ends = ", ".join(f"{k} {v:.2f}" for k, v in r["parts_end_mib"].items())
    lines += [
        f"redis used_memory: {r['used_warm_mib']:.1f} MiB at warm-up, {r['used_end_mib']:.1f} at "
        f"the end ({r['mib_per_h']:+.2f} MiB/h, {r['pct_per_h']:+.2f} %/h); RSS {r['rss_end_mib']:.1f} MiB",
        f"  less the seen sets: {r['less_seen_mib_per_h']:+.2f} MiB/h ({r['less_seen_pct_per_h']:+.2f} %/h)",
        f"  by part, MiB/h after warm-up: {parts}",
        f"  by part at the end, MiB: {ends}",
        f"  seen sets: {r['seen_ids_warm_end'][0]} ids at warm-up, {r['seen_ids_warm_end'][1]} at "
        f"the end, {r['seen_bytes_per_id'][0]}-{r['seen_bytes_per_id'][1]} bytes an id",
        f"  streams {r['streams_end_mib']:.2f} MiB at the end, largest ever {r['largest_stream_mib']:.2f} "
        f"MiB (budget {r['stream_budget_mib']:.1f} MiB a stream); seen sets {r['seen_end_mib']:.2f} MiB; "
        f"admission held in {100 * r['held_share']:.0f} % of samples; "
        f"task and trajectory entries: {r['trimmed_entries']} trimmed, {r['held_entries']} held "
        "at the end",
        f"work dir on disk: {d['warm_mib']:.1f} MiB at warm-up, {d['end_mib']:.1f} at the end "
        f"({d['mib_per_h']:+.1f} MiB/h: logs, checkpoints, weights, Redis's AOF)",
        f"books: {b['issued']} tasks issued, {b['accounted']} accounted for, lost {b['lost']} "
        f"(worst sample {b['worst_lost']})",
        f"learner: {lr['steps']} steps, {lr['skipped']} skipped batches; reward by tenth of the "
        f"run: {' '.join('-' if x is None else f'{x:.2f}' for x in lr['rewards'])}",
    ]
    lines += [f"  warning: {w}" for w in lr["warnings"]]
    series = r["series"]
    picks = sorted({round(i * (len(series) - 1) / 10) for i in range(11)})
    lines.append("redis over the run, MiB: t(min) used seen ids streams events overhead rest")
    lines += [
        "  {t_min:6.1f} {used:6.2f} {seen:6.2f} {seen_ids:7.0f} {streams:6.2f} {events:6.2f} "
        "{overhead:6.2f} {unattributed:6.2f}".format(**series[i])
        for i in picks
    ]
    goals = result["goals"]
    lines.append(
        "goals: every process but Redis < 10 %/h: {}; Redis less its seen sets flat, streams "
        "within budget: {}; nothing lost: {}".format(*("yes" if goals[k] else "NO" for k in goals))
    )
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench soak",
        description=__doc__.splitlines()[0],
        formatter_class=HelpFormatter,
    )
    parser.add_argument("--minutes", type=float, default=60.0, help="soak length after start-up")
    parser.add_argument("--warmup-min", type=float, default=20.0, help="left out of the slopes")
    parser.add_argument("--sample-s", type=float, default=30.0, help="seconds between samples")
    parser.add_argument("--stream-max-bytes", type=int, default=8 << 20, help="learner's bound")
    parser.add_argument("--seen-ttl-s", type=float, default=900.0, help="dedup ids kept (s)")
    parser.add_argument("--start-budget-s", type=float, default=240.0, help="start-up limit")
    parser.add_argument("--smoke", action="store_true", help="15 s, 5 s warm-up (CI)")
    parser.add_argument("--json", action="store_true", help="table to stderr, envelope to stdout")
    args = parser.parse_args(argv)
    if args.smoke:
        args.minutes, args.warmup_min, args.sample_s, args.seen_ttl_s = 0.25, 1 / 12, 1.5, 60.0
    started = report.start("soak", argv)
    from inference.tiny import build_tiny_model

    with tempfile.TemporaryDirectory(prefix="bench-soak-") as tmp:
        model = build_tiny_model(Path(tmp) / "model", seed=0)
        result = run(model, Path(tmp) / "farm", args)
    return report.emit(started, result, table(result), args.json)
