"""`python -m workers`: start a rollout worker through the farm's one runner (`launch.runner`).

Every `WorkerConfig` field is a flag (``--concurrency 512``), grouped in ``--help`` by
the component it configures; ``--config FILE.toml`` supplies defaults that ``FARM_*``
environment variables and then flags override. The config parses before torch or
transformers are imported. The heavy imports (and ``--env-modules``) happen in the
runner's `prepare`, before stop signals are handled, so a worker stopped while it starts
(``farm up`` interrupted early) ends at once. It takes tasks once an inference server
answers ``/health`` (``farm up`` starts it beside the CPU server, which loads meanwhile),
or after ``--inference-retry-budget-s`` without one, when its episodes fail as usual.
SIGTERM/SIGINT: stop taking tasks, finish what can finish within ``--shutdown-grace-s``,
leave the rest pending, exit 0.
Exit codes: 0 stopped cleanly, 2 bad configuration, 1 runtime failure.
"""

from __future__ import annotations

import asyncio
import importlib
import logging
import sys
from typing import TYPE_CHECKING

from launch.runner import Role, RoleContext, parse, start
from workers.config import WorkerConfig
from workers.errors import TemplateError
from workers.resources import loop_factory

if TYPE_CHECKING:
    from inference.client import GenerationClient
    from workers.tokens import ChatCodec

log = logging.getLogger("workers")


# What `serve` imports, loaded by `_prepare` instead (see there).
_HEAVY_MODULES = (
    "broker.connection",
    "inference.client",
    "workers.agent_endpoint",
    "workers.worker",
)


def _prepare(cfg: WorkerConfig) -> ChatCodec:
    """Process set-up, the heavy imports and the tokenizer, while a SIGTERM still ends the
    process at once (the runner handles stop signals from `serve` on); returns the codec."""
    from broker.memory import tune_malloc
    from workers.resources import import_env_modules, raise_open_files_limit
    from workers.tokens import load_codec

    tune_malloc()
    raise_open_files_limit()
    for name in _HEAVY_MODULES:
        importlib.import_module(name)
    import_env_modules(cfg.env_modules)  # before the tokenizer: see `load_tokenizer`
    # a template it cannot use: TemplateError
    return load_codec(str(cfg.model), cfg.chat.template_kwargs)


async def serve(ctx: RoleContext[WorkerConfig]) -> int:
    """Build the worker's parts, run until the stop event, close everything."""
    from broker.connection import RedisSettings, connect
    from broker.keys import RunKeys
    from inference.client import GenerationClient, SamplingParams
    from workers.agent_endpoint import AgentEndpoint
    from workers.answers import AnswerReader
    from workers.episode import EpisodeContext
    from workers.policy_model import PolicyModel
    from workers.resources import open_sandbox, tune_gc
    from workers.worker import Worker

    cfg = ctx.config
    chat = cfg.chat
    codec: ChatCodec = ctx.prepared
    reader = AnswerReader(codec, chat.tool_parser, chat.reasoning_parser)
    redis = await connect(RedisSettings.from_url(cfg.redis_url))
    client = GenerationClient(cfg.inference_urls, cfg.inference)
    # the run's current LoRA adapter by name, or the base weights (full-weight runs)
    keys = RunKeys(cfg.run, partitions=cfg.partitions)
    model = PolicyModel(client, redis, keys, cfg.policy_refresh_s)
    agents = AgentEndpoint(codec, model, reader=reader, history=chat.reasoning_history)
    try:
        await client.start()
        if not await _until_a_server_answers(client, cfg.inference.retry_budget_s, ctx.stop):
            return 0  # stopped while waiting
        await agents.start()  # localhost, any free port: agent envs' OpenAI endpoint
        async with open_sandbox(cfg.sandbox_backend) as pool:
            episode = EpisodeContext(
                codec=codec,
                client=model,
                sampling=SamplingParams,
                sandbox=pool,
                agents=agents,
                reader=reader,
                history=chat.reasoning_history,
            )
            tune_gc()
            await Worker(cfg, redis, episode).run(ctx.stop)
    finally:
        await agents.close()
        await client.close()
        await redis.aclose()
    return 0


async def _until_a_server_answers(
    client: GenerationClient, limit_s: float, stop: asyncio.Event
) -> bool:
    """Wait for a healthy inference server, at most `limit_s`; False if stopped meanwhile."""
    if await client.wait_healthy(0):
        return True
    log.info("waiting up to %.0fs for an inference server to answer /health", limit_s)
    waiting = asyncio.create_task(client.wait_healthy(limit_s), name="inference-wait")
    stopping = asyncio.create_task(stop.wait(), name="stop-wait")
    try:
        await asyncio.wait({waiting, stopping}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        waiting.cancel()
        stopping.cancel()
    if stop.is_set():
        return False
    if not waiting.result():
        log.warning("no inference server answered /health within %.0fs; starting anyway", limit_s)
    return True


ROLE = Role(
    name="workers",
    config=WorkerConfig,
    main=serve,
    description="Rollout worker of the rollout farm (see docs/workers.md).",
    prepare=_prepare,
    loop_factory=lambda cfg: loop_factory(cfg.event_loop),
    failures=(TemplateError,),  # one line naming the template, exit 1, at start-up
)


def load_config(argv: list[str]) -> WorkerConfig:
    """The config `argv` resolves to (raises ConfigError)."""
    return parse(ROLE, argv)[0]


def main(argv: list[str] | None = None) -> int:
    return start(ROLE, argv)


if __name__ == "__main__":
    sys.exit(main())
