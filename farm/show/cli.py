"""`python -m broker show` (`python -m farm.show`): the command.

Picks one group (``--group``, ``--entry`` or the latest) from a live stream or an
archive (``--archive``), decodes it with the run's tokenizer, computes advantages
with the run's batch rules, and prints it with colour or writes ``--html FILE``.
Where the tokenizer and the rules come from: ``--learner-config`` (the learner's
TOML: its ``model`` and its batch rules), ``--tokenizer`` (a model or tokenizer
directory; it overrides the TOML's model), or neither (ids shown, default rules).

Exit status: 0 shown; 2 bad arguments (tokenizer, config or archive unreadable, a bad
entry id, an --html file that cannot be written);
3 no such group or entry; 4 the entry is not a decodable group.

`python -m broker show` hands its arguments to this module (`broker.show.cli`): the
run's settings are the broker command's (`BrokerCliConfig`), and the decoding and the
learner's rules live here, above the learner and the workers.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import redis.asyncio as aioredis

from broker.cli_config import BrokerCliConfig, resolve_stream
from broker.connection import RedisSettings, connect
from broker.errors import BrokerError
from broker.keys import RunKeys
from broker.show.cli import add_show_command
from broker.show.source import (
    GroupNotFound,
    Located,
    MalformedEntry,
    Selector,
    ShowError,
    from_archive,
    from_streams,
)
from farm.show.html import render_html
from farm.show.terminal import PipeConsole, render
from farm.show.view import build_view, ids_only
from launch.runner import Role, RoleContext, start
from learner.config import BatchRules, LearnerConfig
from learner.errors import ConfigError
from learner.spans import Decoder
from workers.tokens import load_codec

EXIT_CODES: dict[type[ShowError], int] = {GroupNotFound: 3, MalformedEntry: 4, ShowError: 2}


def _run_settings(args: argparse.Namespace) -> tuple[BatchRules, str | None]:
    """(BatchRules, tokenizer directory or None) from the options."""
    if not args.learner_config:
        return BatchRules(), args.tokenizer
    cli = {"model": args.tokenizer} if args.tokenizer else {}
    try:
        cfg = LearnerConfig.load(cli, Path(args.learner_config))
    except ConfigError as exc:
        raise ShowError(f"learner config {args.learner_config}: {exc}") from exc
    return cfg.batch, str(cfg.model)


def _decoder(tokenizer: str | None) -> Decoder:
    if tokenizer is None:
        return ids_only
    try:
        codec = load_codec(tokenizer)
    except (OSError, ValueError) as exc:
        raise ShowError(f"cannot load a tokenizer from {tokenizer}: {exc}") from exc
    return lambda ids: codec.decode(ids, skip_special=False)


async def _locate(redis: aioredis.Redis | None, streams: Sequence[str], args: Any) -> Located:
    want = Selector(group_id=args.group, entry_id=args.entry)  # ShowError: a bad entry id
    if args.archive:
        return await asyncio.to_thread(from_archive, args.archive, want)
    assert redis is not None and streams
    return await from_streams(redis, streams, want)


async def show(
    redis: aioredis.Redis | None, streams: Sequence[str], args: argparse.Namespace
) -> int:
    """Run `show` over `streams` (every partition's, or the one named); `redis` may be None
    and `streams` empty with ``--archive``."""
    try:
        rules, tokenizer = _run_settings(args)
        decode = _decoder(tokenizer)
        found = await _locate(redis, streams, args)
    except ShowError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_CODES[type(exc)]
    view = build_view(
        found.group, found.entry_id, found.origin, rules, decode=decode, tokenizer=tokenizer
    )
    if args.html:
        page = render_html(view)
        try:
            await asyncio.to_thread(Path(args.html).write_text, page, encoding="utf-8")
        except OSError as exc:
            print(f"error: cannot write {args.html}: {exc}", file=sys.stderr)
            return 2
        print(f"wrote group {view.group_id} ({found.entry_id}) to {args.html}")
        return 0
    render(view, PipeConsole(highlight=False))
    return 0


async def amain(ctx: RoleContext[BrokerCliConfig]) -> int:
    cfg, args = ctx.config, ctx.args
    if args.archive:  # an archive needs no Redis
        return await show(None, [], args)
    settings = RedisSettings.from_url(
        cfg.redis_url, retry_budget_s=cfg.redis_wait, tls_ca_file=cfg.redis_ca_file
    )
    redis = await connect(settings)
    try:
        keys = RunKeys(cfg.run, cfg.partitions)
        # Plain `trajectories` means the run's groups wherever they were published.
        named = args.stream
        streams = (
            keys.all_trajectories if named == "trajectories" else [resolve_stream(keys, named)]
        )
        return await show(redis, streams, args)
    finally:
        await redis.aclose()


def _add_commands(parser: argparse.ArgumentParser) -> None:
    add_show_command(parser.add_subparsers(dest="command", required=True))


ROLE = Role(
    name="farm.show",
    config=BrokerCliConfig,
    main=amain,
    description="render one trajectory group for a person (python -m broker show)",
    add_arguments=_add_commands,
    metrics_port=lambda cfg: 0,
    failures=(BrokerError, ValueError, argparse.ArgumentTypeError),
)


def main(argv: list[str] | None = None) -> int:
    """`python -m farm.show [run options] show [show options]`, as `python -m broker` takes them."""
    return start(ROLE, argv)
