"""The load generator (`bench._loadgen`) in its own process, for the benchmarks that drive it.

`loadgen` starts one inside a running event loop for one phase of a benchmark and stops it
after. `loadgen_process` starts one outside any loop, so that one server can serve phases
run on different event loops (`bench workers --smoke`: a start-up is seconds, as the
server imports torch through `inference.protocol`); `serving` hands a phase that shared
server when it serves the phase's latency profile, or starts its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import AsyncIterator, Iterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager, contextmanager
from dataclasses import dataclass

START_S = 60.0  # a start-up is a few seconds; this is for a loaded machine


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _argv(port: int, median_ms: float, sigma: float, extra: tuple[str, ...]) -> list[str]:
    return [
        *("-m", "bench._loadgen", "--port", str(port), "--median-ms", str(median_ms)),
        *("--sigma", str(sigma), *extra),
    ]


@asynccontextmanager
async def loadgen(median_ms: float, sigma: float, *extra: str) -> AsyncIterator[str]:
    """The latency-simulating server, in its own process; `extra`: more CLI arguments."""
    import aiohttp

    port = free_port()
    proc = await asyncio.create_subprocess_exec(
        sys.executable, *_argv(port, median_ms, sigma, extra)
    )
    url = f"http://127.0.0.1:{port}"
    try:
        async with aiohttp.ClientSession() as session:
            for _ in range(400):
                try:
                    async with session.get(url + "/health", timeout=aiohttp.ClientTimeout(1)):
                        break
                except (aiohttp.ClientError, TimeoutError):
                    await asyncio.sleep(0.05)
        yield url
    finally:
        proc.terminate()
        try:  # aiohttp's graceful stop waits for in-flight (sleeping) requests
            await asyncio.wait_for(proc.wait(), 5)
        except TimeoutError:
            proc.kill()
            await proc.wait()


@dataclass(frozen=True)
class Server:
    """A running load generator and the latency profile it serves."""

    url: str
    median_ms: float  # median latency of a request
    sigma: float  # log-normal sigma of the latency


@contextmanager
def loadgen_process(median_ms: float, sigma: float) -> Iterator[Server]:
    """A load generator for a whole run, started and stopped outside any event loop."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, *_argv(port, median_ms, sigma, ())])
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + START_S
        while True:
            try:
                with urllib.request.urlopen(url + "/health", timeout=1):
                    break
            except OSError as exc:
                if proc.poll() is not None or time.monotonic() > deadline:
                    status = proc.poll()
                    raise RuntimeError(f"the load generator did not start (exit {status})") from exc
                time.sleep(0.05)
        yield Server(url, median_ms, sigma)
    finally:
        proc.terminate()
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def serving(
    shared: Server | None, median_ms: float, sigma: float
) -> AbstractAsyncContextManager[str]:
    """The URL of `shared` when there is one (it must serve this profile), else of a fresh server."""
    if shared is None:
        return loadgen(median_ms, sigma)
    if (shared.median_ms, shared.sigma) != (median_ms, sigma):
        raise ValueError(
            f"the shared load generator serves {shared.median_ms} ms (sigma {shared.sigma}), "
            f"this phase needs {median_ms} ms (sigma {sigma})"
        )
    return contextlib.nullcontext(shared.url)
