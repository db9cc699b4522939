"""`python -m workers`: start a rollout worker through the farm's one runner (`launch.runner`).

Every `WorkerConfig` field is a flag (``--concurrency 512``), grouped in ``--help`` by
the component it configures; ``--config FILE.toml`` supplies defaults that ``FARM_*``
environment variables and then flags override. The config parses before torch or
transformers are imported. SIGTERM/SIGINT: stop taking tasks, finish what can finish
within ``--shutdown-grace-s``, leave the rest pending, exit 0.
Exit codes: 0 stopped cleanly, 2 bad configuration, 1 runtime failure.
"""

from __future__ import annotations

import sys

from launch.runner import Role, RoleContext, parse, start
from workers.config import WorkerConfig
from workers.errors import TemplateError
from workers.resources import loop_factory


def _prepare(cfg: WorkerConfig) -> None:
    from broker.memory import tune_malloc
    from workers.resources import raise_open_files_limit

    tune_malloc()
    raise_open_files_limit()


async def serve(ctx: RoleContext[WorkerConfig]) -> int:
    """Build the worker's parts, run until the stop event, close everything."""
    from broker.connection import RedisSettings, connect
    from broker.keys import RunKeys
    from inference.client import GenerationClient, SamplingParams
    from workers.agent_endpoint import AgentEndpoint
    from workers.answers import AnswerReader
    from workers.episode import EpisodeContext
    from workers.policy_model import PolicyModel
    from workers.resources import import_env_modules, open_sandbox, tune_gc
    from workers.tokens import load_codec
    from workers.worker import Worker

    cfg = ctx.config
    import_env_modules(cfg.env_modules)
    chat = cfg.chat
    codec = load_codec(
        str(cfg.model), chat.template_kwargs
    )  # a template it cannot use: TemplateError
    reader = AnswerReader(codec, chat.tool_parser, chat.reasoning_parser)
    redis = await connect(RedisSettings.from_url(cfg.redis_url))
    client = GenerationClient(cfg.inference_urls, cfg.inference)
    # the run's current LoRA adapter by name, or the base weights (full-weight runs)
    keys = RunKeys(cfg.run, partitions=cfg.partitions)
    model = PolicyModel(client, redis, keys, cfg.policy_refresh_s)
    agents = AgentEndpoint(codec, model, reader=reader, history=chat.reasoning_history)
    try:
        await client.start()
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
