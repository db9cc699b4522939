"""What `bench soak` samples from a running farm: its processes, its Redis, its books.

- `disk_mib`: the farm's work directory on disk;
- `processes`: the farm's process tree by role (supervisor, redis, inference, worker-N,
  learner), each with its resident memory (VmRSS) and open file descriptors, from /proc;
- `redis_probe`: Redis's used and resident memory; the bytes of every key it holds by kind
  (the run's streams, its policy events, its seen sets, other keys; MEMORY USAGE) and of
  Redis's own overhead and client buffers (MEMORY STATS), so that a growth is attributed;
  the seen sets' ids; whether admission is held; and the entries added to and held by the
  tasks and trajectories streams (the difference is what the learner trimmed);
- `books`: one MULTI/EXEC snapshot of the counters that account for every task issued
  (`entries-added` survives trimming): each one is waiting or pending on a tasks stream,
  dead-lettered, or a group on a trajectories stream that the learner has read or has
  still to read. Whatever is missing was lost (trimmed before it was consumed).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis

from broker.codec import decode
from broker.errors import DecodeError
from broker.keys import LEARNER_GROUP, WORKERS_GROUP, RunKeys
from broker.messages import DeadLetter

ROLES = (("redis-server", "redis"), ("-m inference", "inference"), ("-m learner", "learner"))


@dataclass(frozen=True)
class Proc:
    """One process of the farm at one sample."""

    role: str
    pid: int
    rss_mib: float
    fds: int


def _children() -> dict[int, list[int]]:
    tree: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):  # exited meanwhile
            continue
        tree.setdefault(ppid, []).append(int(entry.name))
    return tree


def _role(pid: int, root: int) -> str | None:
    if pid == root:
        return "supervisor"
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return None
    for needle, role in ROLES:
        if needle in cmd:
            return role
    if "-m workers" in cmd:
        marker = "--worker-id "
        return cmd.split(marker, 1)[1].split()[0] if marker in cmd else "worker"
    return None


def _measure(pid: int) -> tuple[float, int] | None:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        fds = len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return None
    kb = next((int(x.split()[1]) for x in status.splitlines() if x.startswith("VmRSS:")), 0)
    return kb / 1024, fds


def processes(root: int) -> list[Proc]:
    """The farm's processes under `root` (the `farm up` process), by role."""
    tree, out, frontier = _children(), [], [root]
    while frontier:
        pid = frontier.pop()
        frontier += tree.get(pid, [])
        role = _role(pid, root)
        if role is not None and (measured := _measure(pid)) is not None:
            out.append(Proc(role, pid, *measured))
    return out


def disk_mib(directory: Path) -> float:
    """What the farm's work directory holds (logs, checkpoints, weights, Redis's AOF)."""
    total = 0
    for root, _, files in os.walk(directory):
        for name in files:
            try:
                total += os.stat(os.path.join(root, name)).st_size
            except OSError:  # replaced meanwhile (a checkpoint rotating)
                continue
    return total / (1 << 20)


def _usage(client: redis.Redis, key: str) -> int:
    return int(client.memory_usage(key, samples=0) or 0)


def _entries(client: redis.Redis, keys: RunKeys) -> tuple[int, int]:
    """(entries added, entries held) of the tasks and trajectories streams so far."""
    added = held = 0
    for stream in (*keys.all_tasks, *keys.all_trajectories):
        if client.exists(stream):
            info = client.xinfo_stream(stream)
            added, held = added + int(info["entries-added"]), held + int(info["length"])
    return added, held


def _stat(stats: dict, name: str) -> int:
    """One field of MEMORY STATS, whichever way the client decoded its names."""
    return int(stats.get(name, stats.get(name.encode(), 0)) or 0)


def _seen_keys(keys: RunKeys) -> list[str]:
    return [keys.seen(g, p) for g in (WORKERS_GROUP, LEARNER_GROUP) for p in range(keys.partitions)]


def _key_usage(client: redis.Redis) -> dict[str, int]:
    """Bytes of every key Redis holds (MEMORY USAGE), by name."""
    return {raw.decode(): _usage(client, raw) for raw in client.scan_iter(count=1000)}


def redis_probe(client: redis.Redis, keys: RunKeys) -> dict[str, Any]:
    """Redis's memory (MiB): used and resident; every key's bytes by kind (the run's work and
    record streams, its policy events, its seen sets, anything else: hashes, counters, other
    runs); Redis's own overhead and client buffers (MEMORY STATS); the largest stream; the
    seen sets' ids; the work streams' entries trimmed so far."""
    info = client.info("memory")
    stats = client.memory_stats()
    mib = 1 << 20
    usage = _key_usage(client)
    seen = _seen_keys(keys)
    streams = [usage.get(s, 0) for s in keys.streams if s != keys.policy_events]
    events = usage.get(keys.policy_events, 0)
    seen_bytes = sum(usage.get(k, 0) for k in seen)
    clients = _stat(stats, "clients.normal") + _stat(stats, "clients.slaves")
    return {
        "used_mib": info["used_memory"] / mib,
        "rss_mib": info["used_memory_rss"] / mib,
        "streams_mib": (sum(streams) + events) / mib,
        "largest_stream_mib": max([*streams, events]) / mib,
        "seen_mib": seen_bytes / mib,
        "seen_ids": sum(int(client.zcard(k)) for k in seen),
        "events_mib": events / mib,
        "other_keys_mib": (sum(usage.values()) - sum(streams) - events - seen_bytes) / mib,
        # MEMORY STATS counts the client buffers inside its overhead: split out, they are
        # what a slow reader or a big reply would grow.
        "overhead_mib": (_stat(stats, "overhead.total") - clients) / mib,
        "clients_mib": clients / mib,
        "held": float(client.hexists(keys.admission, "held_reason")),
        "entries": _entries(client, keys),
    }


def _task_letters(client: redis.Redis, keys: RunKeys) -> int:
    """Dead letters of tasks (a group dead-lettered by the learner was read: counted there)."""
    count = 0
    for stream in keys.all_deadletters:
        for _, fields in client.xrange(stream):
            try:
                letter = decode(fields, expect=DeadLetter)
            except DecodeError:
                continue
            count += isinstance(letter, DeadLetter) and letter.source_stream in keys.all_tasks
    return count


def _group(groups: list[dict], name: str) -> dict | None:
    return next((g for g in groups if g["name"].decode() == name), None)


def books(client: redis.Redis, keys: RunKeys) -> dict[str, int | None]:
    """Tasks issued, and each one's whereabouts, from one consistent snapshot."""
    streams = [*keys.all_tasks, *keys.all_trajectories]
    if not all(client.exists(s) for s in streams):
        return {"issued": 0, "accounted": 0, "lost": 0}
    with client.pipeline(transaction=True) as pipe:  # one slot per partition: MULTI is exact
        for stream in streams:
            pipe.xinfo_stream(stream)
            pipe.xinfo_groups(stream)
        replies = pipe.execute()
    issued = accounted = 0
    for stream, info, groups in zip(streams, replies[::2], replies[1::2], strict=True):
        name = WORKERS_GROUP if stream in keys.all_tasks else LEARNER_GROUP
        group = _group(groups, name)
        if stream in keys.all_tasks:
            issued += int(info["entries-added"])
            if group is None:
                accounted += int(info["length"])
                continue
        elif group is None:
            accounted += int(info["length"])
            continue
        if group["lag"] is None:
            return {"issued": issued, "accounted": None, "lost": None}  # Redis cannot tell
        accounted += int(group["lag"]) + (
            int(group["pending"]) if stream in keys.all_tasks else int(group["entries-read"])
        )
    accounted += _task_letters(client, keys)
    return {"issued": issued, "accounted": accounted, "lost": issued - accounted}
