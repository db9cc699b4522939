"""`python -m inference`: run the CPU policy server until SIGTERM/SIGINT.

It starts through the farm's one runner (`launch.runner`): flags override
`FARM_INFERENCE_*` environment variables, which override `--config FILE.toml` (keys at
top level or under `[inference]`); the resolved config is logged with the API key
masked. `--help` answers without importing torch; the heavy imports happen in the
runner's `prepare`, before stop signals are handled, so a SIGTERM during them ends the
process at once. Once listening it prints
``READY <url>``; a dead engine loop ends the process with status 1.
"""

from __future__ import annotations

import asyncio
import importlib
import logging
import os
import sys

from inference.config import ServerConfig
from inference.errors import InferenceError
from launch.runner import Role, RoleContext, start

log = logging.getLogger("inference")


def _prepare(config: ServerConfig) -> None:
    """Torch's threads and the server's imports, while a SIGTERM still ends the process at
    once (the runner handles stop signals from `_serve` on)."""
    import torch
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # a server log wants lines, not tqdm bars
    torch.set_num_threads(config.torch_threads or min(4, os.cpu_count() or 1))
    importlib.import_module("inference.server")  # ~1 s of transformers' model code


async def _serve(ctx: RoleContext[ServerConfig]) -> int:
    from inference.server import PolicyServer  # imports torch: only once we really serve

    server = PolicyServer(ctx.config)
    await server.start()
    print(f"READY {server.url}", flush=True)  # supervisors and tests wait for this line
    # A dead engine loop fails this task, and the TaskGroup ends the process loudly.
    engine = ctx.tasks.create_task(server.wait(), name="engine-watch")
    stopping = ctx.tasks.create_task(ctx.stop.wait(), name="stop-signal")
    try:
        await asyncio.wait({engine, stopping}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopping.cancel()
        await server.stop()  # also ends the engine loop, and with it the watch
        log.info("policy server stopped")
    return 0


ROLE = Role(
    name="inference",
    config=ServerConfig,
    main=_serve,
    description="CPU policy server (vLLM subset)",
    prepare=_prepare,
    metrics_port=lambda config: 0,  # the server's own app serves /metrics
    failures=(InferenceError,),
)


def main(argv: list[str] | None = None) -> int:
    return start(ROLE, argv)


if __name__ == "__main__":
    sys.exit(main())
