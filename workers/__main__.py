"""`python -m workers`: parse the config (no torch/transformers import), then run a worker.

Every `WorkerConfig` field is a flag (``--concurrency 512``); ``--config FILE.toml``
supplies defaults that ``FARM_*`` environment variables and then flags override. The
resolved config is logged at start-up. SIGTERM/SIGINT: stop taking tasks, finish what
can finish within ``--shutdown-grace-s``, leave the rest pending, exit 0.
Exit codes: 0 stopped cleanly, 2 bad configuration, 1 runtime failure.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import signal
import sys
from pathlib import Path

from broker.memory import tune_malloc
from broker.settings import add_settings_flags
from workers.config import WorkerConfig
from workers.errors import ConfigError
from workers.resources import loop_factory, raise_open_files_limit

log = logging.getLogger("workers")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m workers",
        description="Rollout worker of the rollout farm (see docs/workers.md).",
        argument_default=argparse.SUPPRESS,
    )
    parser.add_argument("--config", type=Path, help="TOML file with config values")
    add_settings_flags(parser, WorkerConfig)
    return parser


def load_config(argv: list[str]) -> WorkerConfig:
    args = vars(build_parser().parse_args(argv))
    toml = args.pop("config", None)
    return WorkerConfig.load(args, toml)


async def serve(cfg: WorkerConfig, stop: asyncio.Event) -> int:
    """Build the worker's parts, run until `stop`, close everything."""
    from broker.connection import RedisSettings, connect
    from inference.client import ClientConfig, GenerationClient, SamplingParams
    from workers.episode import EpisodeContext
    from workers.resources import import_env_modules, open_sandbox, tune_gc
    from workers.tokens import load_codec
    from workers.worker import Worker

    import_env_modules(cfg.env_modules)
    codec = load_codec(str(cfg.model))
    redis = await connect(RedisSettings.from_url(cfg.redis_url))
    client = GenerationClient(
        cfg.inference_urls,
        ClientConfig(
            api_key=cfg.inference_api_key,
            request_timeout_s=cfg.inference_timeout_s,
            retry_budget_s=cfg.inference_retry_budget_s,
            max_connections=cfg.inference_max_connections,
        ),
    )
    try:
        await client.start()
        async with open_sandbox(cfg.sandbox_backend) as pool:
            ctx = EpisodeContext(codec=codec, client=client, sampling=SamplingParams, sandbox=pool)
            tune_gc()
            await Worker(cfg, redis, ctx).run(stop)
    finally:
        await client.close()
        await redis.aclose()
    return 0


def main(argv: list[str] | None = None) -> int:
    try:
        cfg = load_config(sys.argv[1:] if argv is None else argv)
    except ConfigError as exc:
        print(exc, file=sys.stderr)
        return 2
    logging.basicConfig(
        level=cfg.log_level,
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s %(message)s",
    )
    log.info("%s", json.dumps({"event": "config", **cfg.redacted()}))
    tune_malloc()
    raise_open_files_limit()
    if cfg.metrics_port:
        from prometheus_client import start_http_server

        start_http_server(cfg.metrics_port)

    async def run() -> int:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        return await serve(cfg, stop)

    try:
        with asyncio.Runner(loop_factory=loop_factory(cfg.event_loop)) as runner:
            return runner.run(run())
    except Exception:
        log.exception("worker failed")
        return 1


if __name__ == "__main__":
    sys.exit(main())
