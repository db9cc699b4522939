"""Training from history: archived segments or a range of the trajectories stream.

``--replay DIR`` reads a `broker.archive.Archive` directory; ``--replay
stream:START..END`` (``stream:NAME@START..END`` for another stream, ``-``/``+``
or empty for the ends) reads the run's trajectories stream(s) through XRANGE.
Groups are taken in stream order, in consecutive batches of
``groups_per_batch``; a trailing partial batch is not trained. Nothing is
acked, no task is issued and no weights are pushed; the final weights go to
``checkpoint_dir``. Versions recorded in the data are not this run's, so no
group counts as stale. On CPU with a fixed seed the same data gives
bit-identical weights (deterministic algorithms are switched on).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from pathlib import Path

from broker.codec import decode
from broker.connection import RedisSettings, connect
from broker.errors import DecodeError
from broker.keys import RunKeys
from broker.messages import TrajectoryGroup
from learner.checkpoint import LearnerState
from learner.core import Core, skip_record, step_record
from learner.errors import ReplayError
from learner.progress import Progress
from learner.record import SkipRecord, StepRecord, emit, emit_skip
from learner.source import problem_with

log = logging.getLogger("learner")
Entry = tuple[str, dict[bytes, bytes]]


def parse_stream_range(spec: str) -> tuple[str | None, str | None, str | None]:
    """``stream:[NAME@]START..END`` -> (name or None, start or None, end or None)."""
    body = spec.removeprefix("stream:")
    name, _, span = body.rpartition("@")
    start, sep, end = span.partition("..")
    if not sep:
        raise ReplayError(f"replay range {spec!r} must look like stream:[NAME@]START..END")
    clean = lambda v: None if v in ("", "-", "+") else v  # noqa: E731
    return (name or None), clean(start), clean(end)


async def _entries(spec: str, keys: RunKeys, redis_url: str) -> AsyncIterator[Entry]:
    from broker.replay import ReplayFilter, archive_entries, stream_entries

    if not spec.startswith("stream:"):
        path = Path(spec)
        if not (path / "index.json").is_file():
            raise ReplayError(f"{path} is not an archive directory (no index.json)")
        from broker.archive import Archive

        for entry in archive_entries(Archive(path, readonly=True)):
            yield entry
        return
    name, start, end = parse_stream_range(spec)
    flt = ReplayFilter(start_id=start, end_id=end)
    redis = await connect(RedisSettings.from_url(redis_url))
    try:
        for stream in [name] if name else list(keys.all_trajectories):
            async for entry in stream_entries(redis, stream, flt):
                yield entry
    finally:
        await redis.aclose()


async def replay_groups(spec: str, keys: RunKeys, redis_url: str) -> AsyncIterator[TrajectoryGroup]:
    """Every decodable group of the source, in order (others are logged and skipped)."""
    async for entry_id, fields in _entries(spec, keys, redis_url):
        try:
            message = decode(fields, expect=TrajectoryGroup)
        except DecodeError as exc:
            log.warning("replay skips entry %s: %s", entry_id, exc)
            continue
        assert isinstance(message, TrajectoryGroup)
        yield message


async def batches_of(
    groups: AsyncIterator[TrajectoryGroup],
    size: int,
    usable: Callable[[TrajectoryGroup], str | None],
) -> AsyncIterator[list[TrajectoryGroup]]:
    batch: list[TrajectoryGroup] = []
    async for group in groups:
        problem = usable(group)
        if problem is not None:
            log.warning("replay skips group %s: %s", group.group_id, problem)
            continue
        batch.append(group)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        log.info("replay: %d trailing groups do not fill a batch; not trained", len(batch))


async def run_replay(core: Core, stop: asyncio.Event) -> LearnerState:
    """Rank 0's replay loop; saves the final weights and returns the state."""
    cfg, state = core.cfg, core.state
    assert cfg.replay is not None
    keys = RunKeys(cfg.run, cfg.partitions)
    vocab = int(core.trainer.model.config.vocab_size)  # type: ignore[union-attr]
    groups = replay_groups(cfg.replay, keys, cfg.redis_url)
    progress = Progress.of(cfg.progress)
    async for batch in batches_of(groups, cfg.groups_per_batch, lambda g: problem_with(g, vocab)):
        prepared, stats = core.train(batch, replay=True)
        record: StepRecord | SkipRecord
        if stats is None:  # nothing trainable: not a step
            record = skip_record(core, batch, prepared, 0.0)
            emit_skip(record, prepared)
            core.tracker.skip(record)
        else:
            record = step_record(core, batch, prepared, stats, wait_s=0.0, push_s=0.0)
            emit(record, prepared)
            core.tracker.step(record, batch, prepared)
        solved = progress.observe(record, trained=stats is not None)
        if solved or stop.is_set() or (cfg.max_steps and state.step >= cfg.max_steps):
            break
    core.save()
    return state
