"""`python -m inference`: run the CPU policy server until SIGTERM/SIGINT.

Flags override `FARM_INFERENCE_*` environment variables, which override `--config FILE.toml`
(keys at top level or under `[inference]`). `--help` answers without importing torch.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import sys
from pathlib import Path

from inference.config import ServerConfig, load_server_config


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m inference", description="CPU policy server (vLLM subset)"
    )
    p.add_argument("--config", type=Path, help="TOML file with server settings")
    for name, field in ServerConfig.model_fields.items():
        flag = "--" + name.replace("_", "-")
        # Values stay strings; pydantic validates and converts them with the other sources.
        p.add_argument(flag, dest=name, default=None, help=field.description)
    return p


async def _serve(config: ServerConfig) -> None:
    from inference.server import PolicyServer  # imports torch: only once we really serve

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    server = PolicyServer(config)
    await server.start()
    print(f"READY {server.url}", flush=True)  # supervisors and tests wait for this line
    engine_died = asyncio.create_task(server.wait(), name="engine-watch")
    stopping = asyncio.create_task(stop.wait(), name="stop-signal")
    try:
        await asyncio.wait({engine_died, stopping}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopping.cancel()
        await server.stop()
        logging.getLogger("inference").info("policy server stopped")
        if engine_died.done() and not engine_died.cancelled():
            engine_died.result()  # a dead engine loop ends the process loudly
        else:
            engine_died.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await engine_died


def main(argv: list[str] | None = None) -> int:
    args = vars(_parser().parse_args(argv))
    toml = args.pop("config")
    config = load_server_config(args, toml)
    logging.basicConfig(
        level=config.log_level, format="%(asctime)s %(levelname)s %(name)s %(message)s"
    )
    shown = config.model_dump(mode="json") | {"api_key": "***" if config.api_key else None}
    logging.getLogger("inference").info("config: %s", shown)
    import torch
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # a server log wants lines, not tqdm bars
    torch.set_num_threads(config.torch_threads or min(4, os.cpu_count() or 1))
    asyncio.run(_serve(config))
    return 0


if __name__ == "__main__":
    sys.exit(main())
