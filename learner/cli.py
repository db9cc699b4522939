"""`python -m learner`: start the learner through the farm's one runner (`launch.runner`).

Every `LearnerConfig` field is a flag (``--groups-per-batch 8``; booleans take
``--resume`` / ``--no-resume``), grouped in ``--help`` by the component it configures;
``--config FILE.toml`` supplies defaults that ``FARM_*`` environment variables and then
flags override. The config parses before torch is imported, so ``--help`` is instant.
Under ``torchrun`` rank 0 talks to Redis, the servers and the disk (and serves
/metrics) while every rank trains its slice of each batch.
Exit codes: 0 done, 2 bad configuration, 1 runtime failure.
"""

from __future__ import annotations

import json
import logging
import sys

from launch.runner import Role, RoleContext, parse, process_rank, start
from learner.config import LearnerConfig
from learner.errors import LearnerError

log = logging.getLogger("learner")


def _prepare(cfg: LearnerConfig) -> None:
    from broker.memory import tune_malloc

    tune_malloc()


async def _main(ctx: RoleContext[LearnerConfig]) -> int:
    import os

    import torch  # noqa: F401  (heavy imports only after the config parsed)

    from learner.distributed import init_distributed
    from learner.replay import run_replay
    from learner.service import build_core, resolve_device, run_follower, run_live

    cfg = ctx.config
    device = resolve_device(cfg, int(os.environ.get("LOCAL_RANK", "0")))
    dist = init_distributed(device)
    try:
        core = build_core(cfg, dist, device)
        if not dist.is_main:
            run_follower(core)
            return 0
        run = run_replay if cfg.replay else run_live
        state = await run(core, ctx.stop)
        done = {"event": "done", "step": state.step, "version": state.version}
        log.info("%s", json.dumps({**done, "counters": state.counters}))
    finally:
        dist.close()
    return 0


ROLE = Role(
    name="learner",
    config=LearnerConfig,
    main=_main,
    description="RL learner of the rollout farm (see docs/learner.md).",
    prepare=_prepare,
    metrics_port=lambda cfg: cfg.metrics_port if process_rank() == 0 else 0,
    failures=(LearnerError,),
)


def load_config(argv: list[str]) -> LearnerConfig:
    """The config `argv` resolves to (raises ConfigError)."""
    return parse(ROLE, argv)[0]


def main(argv: list[str] | None = None) -> int:
    return start(ROLE, sys.argv[1:] if argv is None else argv)
