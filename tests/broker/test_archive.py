"""Archive and replay against a real redis-server."""

from __future__ import annotations

import os
import subprocess
import sys

from broker.archive import Archive, archive_stream
from broker.codec import decode
from broker.keys import RunKeys
from broker.producer import Producer
from broker.replay import ReplayFilter, archive_entries, replay, stream_entries
from tests.broker.helpers import make_group

KEYS = RunKeys("arc")


async def fill(redis, n: int, start: int = 0) -> list[str]:
    groups = [make_group(f"g{i}", version=i // 10) for i in range(start, start + n)]
    return await Producer(redis).publish(KEYS.trajectories(), groups)


async def test_archive_is_resumable_and_indexed(redis, tmp_path):
    ids = await fill(redis, 25)
    archive = Archive(tmp_path)
    assert await archive_stream(redis, KEYS.trajectories(), archive, segment_entries=10) == 25
    assert [s.count for s in archive.segments] == [10, 10, 5]
    assert archive.segments[0].min_version == 0 and archive.segments[-1].max_version == 2
    assert archive.segments[0].envs == ("toy",)
    more = await fill(redis, 7, start=25)
    reopened = Archive(tmp_path)  # resumes from the index on disk
    assert await archive_stream(redis, KEYS.trajectories(), reopened, segment_entries=10) == 7
    assert [e[0] for e in reopened.entries()] == ids + more


async def test_segments_are_cut_by_bytes_too(redis, tmp_path):
    """A following archiver holds trimming back by about one segment, so a segment ends
    at --segment-bytes whatever its entry count."""
    await fill(redis, 12)
    size = sum(
        len(v) for _, f in await redis.xrange(KEYS.trajectories(), count=1) for v in f.values()
    )
    archive = Archive(tmp_path)
    n = await archive_stream(redis, KEYS.trajectories(), archive, segment_bytes=3 * size)
    assert n == 12 and [s.count for s in archive.segments] == [3, 3, 3, 3]


async def test_segment_orphaned_by_a_crash_is_adopted(redis, tmp_path):
    await fill(redis, 5)
    archive = Archive(tmp_path)
    await archive_stream(redis, KEYS.trajectories(), archive)
    (tmp_path / "index.json").unlink()  # crash after the segment rename, before the index
    (tmp_path / "seg-junk.tmp").write_bytes(b"half")
    recovered = Archive(tmp_path)
    assert recovered.last_id == archive.last_id
    assert not list(tmp_path.glob("*.tmp"))


async def test_replay_filters_and_keeps_order(redis, tmp_path):
    ids = await fill(redis, 30)
    archive = Archive(tmp_path)
    await archive_stream(redis, KEYS.trajectories(), archive, segment_entries=8)
    n = await replay(
        redis, archive_entries(archive, ReplayFilter(min_version=1, max_version=1)), "{arc}:out"
    )
    assert n == 10
    out = [decode(f).group_id for _, f in await redis.xrange("{arc}:out")]
    assert out == [f"g{i}" for i in range(10, 20)]
    live = [
        e
        async for e in stream_entries(
            redis, KEYS.trajectories(), ReplayFilter(start_id=ids[3], end_id=ids[5])
        )
    ]
    assert [e[0] for e in live] == ids[3:6]
    none = list(archive_entries(archive, ReplayFilter(env="other")))
    assert none == []


async def test_replay_bodies_are_bit_identical(redis, tmp_path):
    await fill(redis, 3)
    archive = Archive(tmp_path)
    await archive_stream(redis, KEYS.trajectories(), archive)
    await replay(redis, archive_entries(archive), "{arc}:copy", rate=100.0)
    original = [f for _, f in await redis.xrange(KEYS.trajectories())]
    copied = [f for _, f in await redis.xrange("{arc}:copy")]
    assert copied == original


async def test_cli_archive_then_replay(redis, redis_server, tmp_path):
    await fill(redis, 12)
    env = {**os.environ, "FARM_REDIS_URL": redis_server.url, "FARM_RUN": "arc"}

    def run(*a: str) -> subprocess.CompletedProcess[str]:
        argv = [sys.executable, "-m", "broker", *a]
        return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60)

    r = run("archive", "trajectories", "--out", str(tmp_path), "--segment-entries", "5")
    assert r.returncode == 0, r.stderr
    assert "archived 12 entries" in r.stdout
    r = run("replay", "--archive", str(tmp_path), "--to", "tasks")
    assert r.returncode == 0, r.stderr
    assert await redis.xlen(KEYS.tasks) == 12
    r = run("status")
    assert r.returncode == 0 and "stream {arc}:trajectories: 12 entries" in r.stdout
