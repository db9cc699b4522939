"""`farm` command line: `up`, `demo`, `eval`, `filter`, `status` and `images`.

`farm up` runs the local stack until Ctrl-C (`--dry-run` prints its commands instead); `farm demo` runs it with demo
settings in a fresh directory and writes a reward curve and a summary; `farm
status` prints a running farm's state from Redis with the broker's own
`run_state`/`format_state`; `farm eval` and `farm filter` bring the stack up without its
learner for one `python -m learner evaluate|filter` (`farm.oneshot`); `farm images build` builds the compose stack's
images offline (`farm.images`). Flags override `FARM_*` environment variables, which
override `--config FILE.toml`. `--help` imports neither torch nor matplotlib.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import sys
import time
from datetime import datetime
from pathlib import Path

from pydantic import ValidationError

from broker.run import RunSection
from farm.config import FarmConfig
from farm.errors import FarmError
from launch.logs import setup_logging
from launch.runner import build_parser
from launch.settings import add_flags, flag_values, helpful

# The settings `farm eval|filter` keep for the stack; every other flag passes through
# to `python -m learner evaluate|filter`.
_ONESHOT = frozenset(
    {"run", "model", "workers", "worker_concurrency", "sandbox_backend", "partitions"}
    | {"env_modules", "work_dir", "worker_args"}
)


# `farm status` reads a run: the run's own fields, flags derived like every role's
_STATUS = frozenset({"run", "redis_url", "partitions"})


def _config_flags(p: argparse.ArgumentParser, only: frozenset[str] | None = None) -> None:
    p.add_argument("--config", type=Path, help="TOML file with farm settings")
    add_flags(p, FarmConfig, only)


def parser() -> argparse.ArgumentParser:
    root = argparse.ArgumentParser(prog="farm", description="Rollout farm on one machine.")
    sub = root.add_subparsers(dest="command", required=True)
    up = sub.add_parser("up", help="run the local stack until Ctrl-C")
    _config_flags(up)
    up.add_argument("--quiet", action="store_true", help="children's logs to files only")
    up.add_argument(
        "--dry-run", action="store_true", help="print every command it would run, start nothing"
    )
    demo = sub.add_parser(
        "demo",
        help="train an environment (the toy; with --model smollm2, arith) and plot the reward",
    )
    _config_flags(demo)
    demo.add_argument(
        "--time-limit-s", type=float, help="stop training after (s; default: the settings' own)"
    )
    demo.add_argument("--verbose", action="store_true", help="show the children's logs")
    status = sub.add_parser("status", help="a running farm's state from Redis")
    add_flags(status, RunSection, _STATUS)
    status.add_argument("--watch", type=float, default=0.0, help="repeat every N seconds")
    for name, what in (("eval", "evaluate"), ("filter", "filter")):
        one = sub.add_parser(
            name,
            help=f"bring the stack up without a learner and run "
            f"`python -m learner {what}` (its flags pass through)",
            epilog=_passed_through(what),
        )
        _config_flags(one, _ONESHOT)
        one.add_argument("--verbose", action="store_true", help="show the children's logs")
    images = sub.add_parser("images", help="build the compose stack's images offline")
    images_sub = images.add_subparsers(dest="images_command", required=True)
    build = images_sub.add_parser("build", help="build what is missing (cached by content tag)")
    build.add_argument(
        "--env-file",
        type=Path,
        help="where to write the tags (default: deploy/compose/.env, which docker-compose reads)",
    )
    build.add_argument(
        "--with",
        dest="with_paths",
        type=Path,
        action="append",
        metavar="PATH",
        help="your package (a project directory or a wheel) in the worker image (repeatable)",
    )
    build.add_argument(
        "--learner-image",
        metavar="IMAGE",
        help="also add the --with packages to this local learner image (FARM_LEARNER_IMAGE)",
    )
    build.add_argument("--quiet", action="store_true", help="print only errors")
    build.add_argument("--force", action="store_true", help="rebuild even if tagged")
    images_sub.add_parser("tags", help="print the content tags a build produces")
    return helpful(root)


def _passed_through(command: str) -> str:
    """The flags of `python -m learner <command>` that `farm eval|filter` pass through (the
    run's own ones are the farm's), as that command's --help lists them."""
    from learner.evaluate import FILTER, ROLE

    role = ROLE if command == "evaluate" else FILTER
    text = build_parser(role).format_help()
    options = text[text.index("\noptions:") + 1 :]
    return f"flags of `python -m learner {command}`, passed through:\n\n{options}"


def main(argv: list[str] | None = None) -> int:
    args, rest = parser().parse_known_args(sys.argv[1:] if argv is None else argv)
    if rest and args.command not in ("eval", "filter"):
        parser().error(f"unrecognized arguments: {' '.join(rest)}")
    setup_logging("INFO")
    try:
        if args.command in ("eval", "filter"):
            return asyncio.run(_oneshot(args, rest))
        if args.command == "status":
            return asyncio.run(_status(args))
        if args.command == "images":
            from farm.images import main_images

            return main_images(args)
        if args.command == "up":
            return asyncio.run(_up(args))
        return asyncio.run(_demo(args))
    except FarmError as exc:
        print(f"farm: {exc}", file=sys.stderr)
        return 1


async def _up(args: argparse.Namespace) -> int:
    from farm.app import run_farm
    from farm.config import load_config
    from farm.console import Console

    cfg = load_config(args.config, **flag_values(args, FarmConfig))
    if args.dry_run:
        from farm.stack import dry_run

        print("\n".join(dry_run(cfg)))
        return 0
    console = Console(log_dir=cfg.work_dir / "logs", echo_children=not args.quiet)
    outcome = await run_farm(cfg, console)
    from farm.demo import stop_reason

    print(f"farm stopped ({stop_reason(outcome, cfg.work_dir / 'logs' / 'learner.log')})")
    return 0


async def _demo(args: argparse.Namespace) -> int:
    from farm import demo
    from farm.app import run_farm
    from farm.console import Console
    from farm.demo_plan import plan_demo

    started, began = time.monotonic(), datetime.now()  # model set-up counts in the wall time
    say = functools.partial(print, "[farm]", flush=True)
    flags = flag_values(args, FarmConfig)
    plan = await asyncio.to_thread(plan_demo, args.config, flags, args.time_limit_s, say)
    cfg = plan.cfg
    console = Console(log_dir=cfg.work_dir / "logs", echo_children=args.verbose)
    console.line("farm", f"demo in {cfg.work_dir} (logs in {cfg.work_dir / 'logs'})")
    console.line("farm", f"settings {plan.row_name} (measured: {plan.row.measured})")
    outcome = await run_farm(cfg, console, time_limit_s=plan.time_limit_s)
    log = cfg.work_dir / "logs" / "learner.log"
    summary = demo.summarize(outcome, time.monotonic() - started, log, began)
    before, after = demo.eval_scores(plan.eval_dir)
    summary |= {"eval_before": before, "eval_after": after, "settings": plan.settings()}
    paths = demo.write_outputs(cfg.work_dir, summary)
    print((cfg.work_dir / "summary.txt").read_text(), end="")
    print("wrote " + ", ".join(str(p) for p in paths))
    return 0 if summary["steps"] > 0 else 1


async def _oneshot(args: argparse.Namespace, rest: list[str]) -> int:
    from farm.config import load_config
    from farm.console import Console
    from farm.oneshot import run_oneshot

    cfg = load_config(args.config, **flag_values(args, FarmConfig))
    console = Console(log_dir=cfg.work_dir / "logs", echo_children=args.verbose)
    command = "evaluate" if args.command == "eval" else "filter"
    return await run_oneshot(cfg, console, command, rest)


async def _status(args: argparse.Namespace) -> int:
    from broker.connection import RedisSettings, connect
    from broker.errors import BrokerError
    from broker.status import format_state, run_state

    given = {k: v for k, v in flag_values(args, RunSection).items() if v is not None}
    try:
        run = RunSection.model_validate(given)
    except ValidationError as exc:
        problems = (
            f"--{'-'.join(map(str, e['loc']))}".replace("_", "-") + f": {e['msg']}"
            for e in exc.errors()
        )
        raise FarmError("; ".join(problems)) from None
    try:
        keys = run.keys()
        redis = await connect(RedisSettings.from_url(run.redis_url, retry_budget_s=2.0))
    except (ValueError, BrokerError) as exc:
        raise FarmError(str(exc)) from exc
    try:
        while True:
            print(format_state(await run_state(redis, keys)), flush=True)
            if not args.watch:
                return 0
            await asyncio.sleep(args.watch)
    finally:
        await redis.aclose()


if __name__ == "__main__":
    raise SystemExit(main())
