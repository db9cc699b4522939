"""`python -m learner`: start the learner through the farm's one runner (`launch.runner`).

Every `LearnerConfig` field is a flag (``--groups-per-batch 8``; booleans take
``--resume`` / ``--no-resume``), grouped in ``--help`` by the component it configures;
``--config FILE.toml`` supplies defaults that ``FARM_*`` environment variables and then
flags override. The config parses before torch is imported, so ``--help`` is instant.
The task dataset is read and every env spec in it checked (after importing
``--env-modules``) before torch is imported or anything is issued; both happen in the
runner's `prepare`, before stop signals are handled, so a learner stopped while it
starts ends at once.
Under ``torchrun`` rank 0 talks to Redis, the servers and the disk (and serves
/metrics) while every rank trains its slice of each batch.
Exit codes: 0 done, 2 bad configuration or task dataset, 3 the run failed (batch after
batch spoiled by infrastructure/spec errors, or every task dead-lettered), 1 any other
runtime failure.
"""

from __future__ import annotations

import importlib
import json
import logging
import sys
from typing import TYPE_CHECKING

from launch.runner import Role, RoleContext, parse, process_rank, start
from launch.settings import masked
from learner.config import LearnerConfig
from learner.errors import LearnerError, RunFailedError, TaskSourceError
from learner.tracking.base import missing_packages, open_tracker

if TYPE_CHECKING:  # torch is imported only once the config and the dataset are checked
    import torch

    from learner.distributed import DistContext

log = logging.getLogger("learner")


# What training imports, loaded by `_prepare` once the inputs are checked (see there).
_HEAVY_MODULES = ("torch", "transformers", "learner.core", "learner.service", "learner.replay")


def _prepare(cfg: LearnerConfig) -> str | None:
    """Check the inputs, then import what training needs, while a SIGTERM still ends the
    process at once (the runner handles stop signals from `_main` on). Returns why the
    inputs cannot be used (`_main` exits 2), or None."""
    from broker.memory import LEARNER, tune_malloc

    tune_malloc(LEARNER)
    try:
        check_inputs(cfg)
    except TaskSourceError as exc:
        return f"learner stopped before issuing a task: {exc}"
    missing = missing_packages(cfg.tracking)
    if missing:
        return f"--tracker needs {', '.join(missing)}: pip install 'rollout-farm[tracking]'"
    for name in _HEAVY_MODULES:  # torch only now: a bad dataset is reported in a moment
        importlib.import_module(name)
    return None


def check_inputs(cfg: LearnerConfig) -> None:
    """Import the env modules and validate the task dataset; raise TaskSourceError."""
    for name in cfg.env_modules:
        try:
            importlib.import_module(name)
        except ImportError as exc:
            raise TaskSourceError(f"cannot import env module {name!r}: {exc}") from exc
    from learner.datasets import load_dataset

    if cfg.tasks is not None and cfg.replay is None:
        load_dataset(cfg.tasks, cfg.data)
    for name, path in cfg.evaluation.sets.items():  # every eval set, before anything is issued
        try:
            load_dataset(path, cfg.data)
        except TaskSourceError as exc:
            raise TaskSourceError(f"eval set {name!r}: {exc}") from exc


async def _main(ctx: RoleContext[LearnerConfig]) -> int:
    if ctx.prepared is not None:  # the inputs cannot be used
        log.error("%s", ctx.prepared)
        return 2
    try:
        await _train(ctx)
    except RunFailedError as exc:
        log.error("learner stopped, the run is failing: %s", exc)
        return 3
    return 0


async def _train(ctx: RoleContext[LearnerConfig]) -> None:
    import os

    from learner.core import resolve_device
    from learner.distributed import init_distributed

    cfg = ctx.config
    device = resolve_device(cfg, int(os.environ.get("LOCAL_RANK", "0")))
    dist = init_distributed(device)
    try:
        await _run(ctx, dist, device)
    finally:  # once _run's model is out of scope: nothing of it holds the group any more
        dist.close()


async def _run(ctx: RoleContext[LearnerConfig], dist: DistContext, device: torch.device) -> None:
    """Build the model and train: rank 0 runs the loop, the other ranks follow it."""
    from learner.core import build_core, run_follower
    from learner.replay import run_replay
    from learner.service import run_live

    cfg = ctx.config
    core = build_core(cfg, dist, device)
    if not dist.is_main:
        run_follower(core)
        return
    run = run_replay if cfg.replay else run_live
    core.tracker = open_tracker(cfg.tracking, cfg.run, masked(cfg), cfg.model)
    try:
        state = await run(core, ctx.stop)
    finally:  # however rank 0's loop ended, the other ranks must not wait forever
        core.stop_followers()
        core.tracker.close()
    done = {"event": "done", "step": state.step, "version": state.version}
    log.info("%s", json.dumps({**done, "counters": state.counters}))


ROLE = Role(
    name="learner",
    config=LearnerConfig,
    main=_main,
    description="RL learner of the rollout farm (see docs/learner.md).",
    epilog="subcommands (each with its own --help):\n"
    "  python -m learner evaluate  one evaluation of the served weights through the farm\n"
    "  python -m learner filter    keep the tasks whose pass rate lies in --keep LO:HI",
    prepare=_prepare,
    metrics_port=lambda cfg: cfg.metrics_port if process_rank() == 0 else 0,
    failures=(LearnerError,),
)


def load_config(argv: list[str]) -> LearnerConfig:
    """The config `argv` resolves to (raises ConfigError)."""
    return parse(ROLE, argv)[0]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["evaluate"]:  # one evaluation, no training (learner.evaluate)
        from learner.evaluate import main as evaluate

        return evaluate(argv[1:])
    if argv[:1] == ["filter"]:  # keep tasks by pass rate (learner.evaluate)
        from learner.evaluate import main_filter

        return main_filter(argv[1:])
    return start(ROLE, argv)
