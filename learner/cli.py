"""`python -m learner`: parse the config (no torch import), then run the learner.

Every `LearnerConfig` field is a flag (``--groups-per-batch 8``; booleans take
``--resume`` / ``--no-resume``); ``--config FILE.toml`` supplies defaults that
``FARM_*`` environment variables and then flags override. The resolved config
is logged at start-up. Under ``torchrun`` rank 0 talks to Redis, the servers
and the disk while every rank trains its slice of each batch.
The task dataset is read and every env spec in it checked (after importing
``--env-modules``) before torch is imported or anything is issued.
Exit codes: 0 done, 2 bad configuration or task dataset, 3 the run failed (batch after
batch spoiled by infrastructure/spec errors, or every task dead-lettered), 1 any other
runtime failure.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import json
import logging
import sys
from pathlib import Path
from typing import Any

from broker.memory import tune_malloc
from broker.settings import add_settings_flags
from learner.config import LearnerConfig
from learner.errors import ConfigError, LearnerError, RunFailedError, TaskSourceError

log = logging.getLogger("learner")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m learner",
        description="RL learner of the rollout farm (see docs/learner.md).",
        argument_default=argparse.SUPPRESS,
    )
    parser.add_argument("--config", type=Path, help="TOML file with config values")
    add_settings_flags(parser, LearnerConfig)
    return parser


def load_config(argv: list[str]) -> LearnerConfig:
    args = vars(build_parser().parse_args(argv))
    toml = args.pop("config", None)
    return LearnerConfig.load(args, toml)


def check_inputs(cfg: LearnerConfig) -> None:
    """Import the env modules and validate the task dataset; raise TaskSourceError."""
    for name in cfg.env_modules:
        try:
            importlib.import_module(name)
        except ImportError as exc:
            raise TaskSourceError(f"cannot import env module {name!r}: {exc}") from exc
    if cfg.tasks is not None and cfg.replay is None:
        from learner.tasks import load_dataset

        load_dataset(cfg.tasks)


def _setup_logging() -> None:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s %(message)s")  # fmt: skip


def _run(cfg: LearnerConfig) -> None:
    import torch  # noqa: F401  (heavy imports only after the config parsed)

    from learner.distributed import init_distributed
    from learner.replay import run_replay
    from learner.service import build_core, install_stop, resolve_device, run_follower, run_live

    local_rank = int(__import__("os").environ.get("LOCAL_RANK", "0"))
    device = resolve_device(cfg, local_rank)
    dist = init_distributed(device)
    try:
        core = build_core(cfg, dist, device)
        if not dist.is_main:
            run_follower(core)
            return
        if cfg.metrics_port:
            from prometheus_client import start_http_server

            start_http_server(cfg.metrics_port)

        async def main() -> Any:
            stop = asyncio.Event()
            install_stop(stop)
            return await (run_replay(core, stop) if cfg.replay else run_live(core, stop))

        try:
            state = asyncio.run(main())
        finally:  # however rank 0's loop ended, the other ranks must not wait forever
            core.stop_followers()
        log.info("%s", json.dumps({"event": "done", "step": state.step, "version": state.version,
                                   "counters": state.counters}))  # fmt: skip
    finally:
        dist.close()


def main(argv: list[str] | None = None) -> int:
    _setup_logging()
    try:
        cfg = load_config(sys.argv[1:] if argv is None else argv)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    log.info("%s", json.dumps({"event": "config", **cfg.model_dump(mode="json")}))
    try:
        check_inputs(cfg)
    except TaskSourceError as exc:
        log.error("learner stopped before issuing a task: %s", exc)
        return 2
    tune_malloc()
    try:
        _run(cfg)
    except RunFailedError as exc:
        log.error("learner stopped, the run is failing: %s", exc)
        return 3
    except LearnerError as exc:
        log.error("learner failed: %s", exc)
        return 1
    return 0
