"""`python -m broker show`: the arguments and the command.

Picks one group (``--group``, ``--entry`` or the latest) from a live stream or an
archive (``--archive``), decodes it with the run's tokenizer, computes advantages
with the run's batch rules, and prints it with colour or writes ``--html FILE``.
Where the tokenizer and the rules come from: ``--learner-config`` (the learner's
TOML: its ``model`` and its batch rules), ``--tokenizer`` (a model or tokenizer
directory; it overrides the TOML's model), or neither (ids shown, default rules).

Exit status: 0 shown; 2 bad arguments (tokenizer, config or archive unreadable, a bad
entry id, an --html file that cannot be written);
3 no such group or entry; 4 the entry is not a decodable group.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import redis.asyncio as aioredis

from broker.show.source import (
    GroupNotFound,
    Located,
    MalformedEntry,
    Selector,
    ShowError,
    from_archive,
    from_streams,
)

if TYPE_CHECKING:
    from broker.show.view import Decoder

EXIT_CODES: dict[type[ShowError], int] = {GroupNotFound: 3, MalformedEntry: 4, ShowError: 2}


def add_show_command(sub: Any) -> None:
    """Register `show` on the subparsers of `python -m broker`."""
    sh = sub.add_parser("show", help="render one trajectory group (latest, or by id) for a person")
    which = sh.add_mutually_exclusive_group()
    which.add_argument("--group", help="group id (the task id); default: the latest entry")
    which.add_argument("--entry", help="stream entry id, as `tail` prints it")
    where = sh.add_mutually_exclusive_group()
    where.add_argument(
        "--stream",
        default="trajectories",
        help="live stream (default: %(default)s, every partition's; `trajectories:2` one)",
    )
    where.add_argument("--archive", help="archive directory (`python -m broker archive --out`)")
    sh.add_argument("--tokenizer", help="model or tokenizer directory that decodes the tokens")
    sh.add_argument("--learner-config", help="the learner's TOML: model and advantage rules")
    sh.add_argument("--html", help="write a self-contained HTML page here instead of printing")


def _run_settings(args: argparse.Namespace) -> tuple[Any, str | None]:
    """(BatchRules, tokenizer directory or None) from the options."""
    from learner.config import BatchRules, LearnerConfig
    from learner.errors import ConfigError

    if not args.learner_config:
        return BatchRules(), args.tokenizer
    cli = {"model": args.tokenizer} if args.tokenizer else {}
    try:
        cfg = LearnerConfig.load(cli, Path(args.learner_config))
    except ConfigError as exc:
        raise ShowError(f"learner config {args.learner_config}: {exc}") from exc
    return cfg.batch, str(cfg.model)


def _decoder(tokenizer: str | None) -> Decoder:
    from broker.show.view import ids_only

    if tokenizer is None:
        return ids_only
    from workers.tokens import load_codec

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
    from broker.show.view import build_view

    view = build_view(
        found.group, found.entry_id, found.origin, rules, decode=decode, tokenizer=tokenizer
    )
    if args.html:
        from broker.show.html import render_html

        page = render_html(view)
        try:
            await asyncio.to_thread(Path(args.html).write_text, page, encoding="utf-8")
        except OSError as exc:
            print(f"error: cannot write {args.html}: {exc}", file=sys.stderr)
            return 2
        print(f"wrote group {view.group_id} ({found.entry_id}) to {args.html}")
        return 0
    from broker.show.terminal import PipeConsole, render

    render(view, PipeConsole(highlight=False))
    return 0
