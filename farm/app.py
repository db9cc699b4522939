"""`farm up` as a coroutine: prepare the run, supervise the stack, show its state.

`run_farm` wires the pieces together: `stack.prepare` and `stack.build_stack` decide
the processes, the `Supervisor` runs them, and two services run beside them while
the farm is up: the status view (`view.FarmView`, printed through the `Console`
every `status_interval_s`) and the time limit; the supervisor's own `/metrics` endpoint is up from before the
first child starts until the last one has stopped, and `monitor.TargetsFile` keeps
`<work_dir>/targets.json` listing the running children's endpoints for Prometheus.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from broker.connection import RedisSettings
from broker.keys import RunKeys
from farm.config import FarmConfig
from farm.console import Console
from farm.errors import StartupError
from farm.monitor import TARGETS, TargetsFile
from farm.stack import Stack, build_stack, command_line, prepare
from farm.supervisor import RestartPolicy, Supervisor
from farm.view import FarmStatus, FarmView


@dataclass
class FarmOutcome:
    """How a farm run ended, and what it saw."""

    stack: Stack
    stop_reason: str
    last_status: FarmStatus | None
    reward_history: list[tuple[int, float, float]]


async def run_farm(
    cfg: FarmConfig, console: Console, *, time_limit_s: float | None = None
) -> FarmOutcome:
    """Run the stack until SIGINT/SIGTERM, the learner finishing, or `time_limit_s`."""
    model, tasks = await prepare(cfg, console.line)
    stack = build_stack(cfg, model, tasks)
    console.line("farm", "config " + cfg.model_dump_json())
    for spec in stack.specs:
        console.line("farm", f"process {spec.name}: {command_line(spec)}")
    targets = TargetsFile(cfg.work_dir.resolve() / TARGETS, stack.metrics_urls, cfg.metrics_port)
    supervisor = Supervisor(
        stack.specs, console.line, RestartPolicy(max_restarts=cfg.restart_max), targets.child
    )
    supervisor.install_signal_handlers()
    redis = RedisSettings.from_url(
        stack.redis_url, socket_timeout_s=3.0, connect_timeout_s=2.0
    ).client()
    view = FarmView(stack.metrics_urls, redis, RunKeys(cfg.run, cfg.partitions))
    last: list[FarmStatus] = []

    async def status_view(stop: asyncio.Event) -> None:
        while not stop.is_set():
            status = await view.poll()
            last[:] = [status]
            console.status(status.line())
            for text in status.new_eval:  # an evaluation finished since the last poll
                console.line("eval", text)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), cfg.status_interval_s)

    async def announce(stop: asyncio.Event) -> None:
        console.line("farm", f"Prometheus targets (file_sd) in {targets.path}")
        if stack.prometheus_url:
            console.line("farm", f"Prometheus at {stack.prometheus_url}/graph")

    async def time_limit(stop: asyncio.Event) -> None:
        if time_limit_s is None:
            return
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), time_limit_s)
        supervisor.request_stop(f"time limit of {time_limit_s:.0f}s reached")

    runner = await serve_metrics(cfg.metrics_port) if cfg.metrics_port else None
    targets.start()
    try:
        await supervisor.run(status_view, time_limit, announce)
        # One last look, so the summary includes the final step.
        with contextlib.suppress(Exception):
            last[:] = [await asyncio.wait_for(view.poll(), 5.0)]
    finally:
        targets.close()
        if runner is not None:
            await runner.cleanup()
        await view.close()
        await redis.aclose()
        console.close()
    return FarmOutcome(
        stack, supervisor.stop_reason, last[0] if last else None, view.reward_history
    )


async def serve_metrics(port: int, host: str = "127.0.0.1") -> web.AppRunner:
    """The supervisor's /metrics (default registry) on host:port."""

    async def metrics(_: web.Request) -> web.Response:
        body = generate_latest()
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    try:
        await web.TCPSite(runner, host, port).start()
    except OSError as exc:
        await runner.cleanup()
        raise StartupError(f"cannot serve /metrics on {host}:{port}: {exc}") from exc
    return runner
