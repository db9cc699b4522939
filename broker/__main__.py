"""`python -m broker`: status, tail, show, archive, replay and dead letters of a run.

Stream arguments take a short name (`tasks`, `trajectories`, `deadletter`, each
with an optional partition as in `trajectories:1`, or `policy`) or a full key.
`status` and `deadletters` cover every partition (``--partitions``). It starts
through the farm's one runner (`launch.runner`): the Redis settings and the run are `BrokerCliConfig` fields
(``--redis-url`` or ``FARM_REDIS_URL``, ``--run`` or ``FARM_RUN``, or a TOML file);
SIGTERM/SIGINT end a ``--watch``, ``--follow`` or archive loop cleanly. `show` draws a
group with the learner's maths, which sit above the broker: this process becomes
`python -m farm.show` with the same arguments (`broker.show.cli.exec_show`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
import time
from collections.abc import Awaitable, Callable

import redis.asyncio as aioredis

from broker.archive import Archive, archive_stream, forget_archiver
from broker.cli_config import BrokerCliConfig, resolve_stream
from broker.codec import decode
from broker.connection import RedisSettings, connect
from broker.deadletters import list_dead_letters, requeue
from broker.errors import BrokerError, DecodeError
from broker.keys import RunKeys
from broker.replay import ReplayFilter, archive_entries, replay, stream_entries
from broker.show.cli import add_show_command, exec_show
from broker.status import format_state, run_state
from launch.runner import Role, RoleContext, build_parser, start

Context = RoleContext[BrokerCliConfig]


def add_commands(p: argparse.ArgumentParser) -> None:
    """The subcommands and their own arguments."""
    sub = p.add_subparsers(dest="command", required=True)
    st = sub.add_parser("status", help="streams, groups, lag, pending, dead letters")
    st.add_argument("--watch", type=float, default=0.0, help="refresh every N seconds")
    tail = sub.add_parser("tail", help="print the last entries of a stream")
    tail.add_argument("stream")
    tail.add_argument("-n", "--count", type=int, default=10)
    tail.add_argument("-f", "--follow", action="store_true")
    ar = sub.add_parser("archive", help="copy a stream into segment files")
    ar.add_argument("stream")
    ar.add_argument("--out", help="archive directory (required unless --forget)")
    ar.add_argument("--segment-entries", type=int, default=10_000)
    ar.add_argument("--segment-bytes", type=int, default=64 << 20, help="bytes per segment")
    ar.add_argument(
        "--follow",
        action="store_true",
        help="keep archiving until SIGTERM; trimming waits for what it has not written",
    )
    ar.add_argument(
        "--forget",
        action="store_true",
        help="remove a retired archiver's group from the stream (trimming stops waiting) and exit",
    )
    rp = sub.add_parser("replay", help="re-publish archived or live entries into a stream")
    src = rp.add_mutually_exclusive_group(required=True)
    src.add_argument("--archive", help="archive directory to read")
    src.add_argument("--from-stream", help="live stream range to read")
    rp.add_argument("--to", required=True, help="target stream")
    rp.add_argument("--start-id")
    rp.add_argument("--end-id")
    rp.add_argument("--since", type=float, help="unix seconds")
    rp.add_argument("--until", type=float, help="unix seconds")
    rp.add_argument("--min-version", type=int)
    rp.add_argument("--max-version", type=int)
    rp.add_argument("--env", help="environment name")
    rp.add_argument("--rate", type=float, help="entries per second (default: as fast as possible)")
    dl = sub.add_parser("deadletters", help="list or requeue dead letters")
    dl.add_argument("action", choices=["list", "requeue"])
    dl.add_argument("ids", nargs="*", help="dead-letter entry ids to requeue")
    dl.add_argument("--all", action="store_true", help="requeue every dead letter")
    add_show_command(sub)


def describe(fields: dict[bytes, bytes]) -> str:
    try:
        message = decode(fields)
    except DecodeError as exc:
        return f"<undecodable: {exc}>"
    text = repr(message)
    return text if len(text) <= 300 else text[:297] + "..."


async def cmd_status(redis: aioredis.Redis, keys: RunKeys, ctx: Context) -> int:
    while True:
        print(format_state(await run_state(redis, keys)), flush=True)
        if not ctx.args.watch:
            return 0
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(ctx.stop.wait(), ctx.args.watch)
        if ctx.stop.is_set():
            return 0


async def cmd_tail(redis: aioredis.Redis, keys: RunKeys, ctx: Context) -> int:
    args = ctx.args
    stream = resolve_stream(keys, args.stream)
    rows = list(reversed(await redis.xrevrange(stream, count=args.count)))
    last = "$"
    for raw_id, fields in rows:
        last = raw_id.decode()
        print(last, describe(fields), flush=True)
    while args.follow and not ctx.stop.is_set():
        reply = await redis.xread({stream: last}, block=1000, count=100)
        for _, entries in reply or []:
            for raw_id, fields in entries:
                last = raw_id.decode()
                print(last, describe(fields), flush=True)
    return 0


async def cmd_archive(redis: aioredis.Redis, keys: RunKeys, ctx: Context) -> int:
    args = ctx.args
    stream = resolve_stream(keys, args.stream)
    if args.forget:
        removed = await forget_archiver(redis, stream)
        print(f"archiver group on {stream}: {'removed' if removed else 'none'}")
        return 0
    if not args.out:
        print("archive needs --out DIR", file=sys.stderr)
        return 2
    archive = Archive(args.out)
    n = await archive_stream(
        redis,
        stream,
        archive,
        segment_entries=args.segment_entries,
        segment_bytes=args.segment_bytes,
        follow=args.follow,
        stop=ctx.stop,
    )
    print(
        f"archived {n} entries from {stream}; last id {archive.last_id}; {len(archive.segments)} segments"
    )
    return 0


async def cmd_replay(redis: aioredis.Redis, keys: RunKeys, ctx: Context) -> int:
    args = ctx.args
    flt = ReplayFilter(
        start_id=args.start_id,
        end_id=args.end_id,
        since_ms=None if args.since is None else int(args.since * 1000),
        until_ms=None if args.until is None else int(args.until * 1000),
        min_version=args.min_version,
        max_version=args.max_version,
        env=args.env,
    )
    source = (
        archive_entries(Archive(args.archive, readonly=True), flt)
        if args.archive
        else stream_entries(redis, resolve_stream(keys, args.from_stream), flt)
    )
    target = resolve_stream(keys, args.to)
    started = time.monotonic()
    n = await replay(redis, source, target, rate=args.rate)
    print(f"replayed {n} entries into {target} in {time.monotonic() - started:.2f}s")
    return 0


async def cmd_deadletters(redis: aioredis.Redis, keys: RunKeys, ctx: Context) -> int:
    args = ctx.args
    letters = await list_dead_letters(redis, keys, count=1_000_000)
    if args.action == "list":
        for entry_id, letter in letters:
            print(
                f"{entry_id} from {letter.source_stream} {letter.entry_id} "
                f"(delivered {letter.deliveries}): {letter.reason}"
            )
        print(f"{len(letters)} dead letters")
        return 0
    ids = [i for i, _ in letters] if args.all else args.ids
    if not ids:
        print("name dead-letter ids to requeue, or --all", file=sys.stderr)
        return 2
    print(f"requeued {await requeue(redis, keys, ids)} of {len(ids)}")
    return 0


COMMANDS: dict[str, Callable[[aioredis.Redis, RunKeys, Context], Awaitable[int]]] = {
    "status": cmd_status,
    "tail": cmd_tail,
    "archive": cmd_archive,
    "replay": cmd_replay,
    "deadletters": cmd_deadletters,
}


async def amain(ctx: Context) -> int:
    cfg = ctx.config
    settings = RedisSettings.from_url(
        cfg.redis_url, retry_budget_s=cfg.redis_wait, tls_ca_file=cfg.redis_ca_file
    )
    redis = await connect(settings)
    try:
        return await COMMANDS[ctx.args.command](redis, RunKeys(cfg.run, cfg.partitions), ctx)
    finally:
        await redis.aclose()


def _prepare(cfg: BrokerCliConfig) -> None:
    from broker.memory import tune_malloc

    tune_malloc()


ROLE = Role(
    name="broker",
    config=BrokerCliConfig,
    main=amain,
    description=__doc__.splitlines()[0],
    add_arguments=add_commands,
    prepare=_prepare,
    metrics_port=lambda cfg: 0,
    failures=(BrokerError, ValueError, argparse.ArgumentTypeError),
)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if build_parser(ROLE).parse_args(argv).command == "show":
        exec_show(argv)  # `show` runs above the learner: `python -m farm.show`, same arguments
    return start(ROLE, argv)


if __name__ == "__main__":
    raise SystemExit(main())
