"""An agent program in the sandbox against the same agent in the worker's process, for
`bench workers`.

Both make the same sequential chat calls to one `AgentEndpoint` over the latency-simulating
server. The in-process agent is an httpx client over the in-process transport, as an `agent`
function gets it (its CPU is counted); the sandboxed one is a stdlib program in a bubblewrap
session (docker where bwrap is missing) that reaches the endpoint through the session's bridge and relay (`Session.run_bridged`) and
times its own calls. Worker CPU per call is this process's CPU over the calls (the program
and the relay run in the sandbox, so theirs is not in it); the added latency is the
program's median call against the in-process agent's.
"""

from __future__ import annotations

import json
import shutil
import statistics
import time
from typing import Any

import orjson

from bench._agent_endpoint import LIMITS, MESSAGES
from workers.agent_endpoint import AgentEndpoint, SamplingDefaults
from workers.agent_record import EpisodeRecord
from workers.episode import EpisodeContext

PROGRAM = """
import http.client, json, os, statistics, sys, time
base = os.environ['OPENAI_BASE_URL']
host, port = base.split('//')[1].split('/')[0].split(':')
body = sys.argv[1].encode()
headers = {'Authorization': 'Bearer ' + os.environ['OPENAI_API_KEY'],
           'Content-Type': 'application/json'}
conn = http.client.HTTPConnection(host, int(port), timeout=60)
took = []
for _ in range(int(sys.argv[2])):
    t0 = time.perf_counter()
    conn.request('POST', '/v1/chat/completions', body, headers)
    reply = conn.getresponse()
    reply.read()
    assert reply.status == 200, reply.status
    took.append(time.perf_counter() - t0)
print(json.dumps({'p50_ms': statistics.median(took) * 1e3}))
"""


def _backend() -> str | None:
    if shutil.which("bwrap"):
        return "bwrap"
    try:
        import docker
    except ImportError:
        return None
    try:
        docker.from_env(timeout=5).ping()
    except docker.errors.DockerException:
        return None
    return "docker"


async def _in_process(endpoint: AgentEndpoint, body: bytes, calls: int) -> tuple[float, float]:
    """(CPU us per call, median ms per call) of an in-process agent's sequential calls, with
    the httpx client over the in-process transport that `OpenAIConfig.client_kwargs()` gives."""
    from workers.agent_transport import in_process_client

    key = endpoint.open_episode(EpisodeRecord(LIMITS, 0), "bench-in", SamplingDefaults(1, 1, 8))
    headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    took = []
    try:
        async with in_process_client(endpoint) as http:
            cpu0 = time.process_time()
            for _ in range(calls):
                t0 = time.perf_counter()
                reply = await http.post(
                    endpoint.base_url + "/chat/completions", content=body, headers=headers
                )
                reply.raise_for_status()
                took.append(time.perf_counter() - t0)
            cpu = time.process_time() - cpu0
    finally:
        endpoint.close_episode(key)
    return cpu / calls * 1e6, statistics.median(took) * 1e3


async def _in_sandbox(
    endpoint: AgentEndpoint, body: bytes, calls: int, backend: str
) -> tuple[float, float]:
    """(worker CPU us per call, the program's median ms per call) in a bridged session."""
    from sandbox import SandboxConfig, SandboxPool

    key = endpoint.open_episode(EpisodeRecord(LIMITS, 0), "bench-sbx", SamplingDefaults(1, 1, 8))
    try:
        async with (
            SandboxPool(SandboxConfig(backend=backend, warm=0)) as pool,
            pool.session(bridge=endpoint.serve_unix) as sb,
        ):
            argv = ["python3", "-c", PROGRAM, body.decode(), str(calls)]
            await sb.run_bridged([*argv[:-1], "1"], env={"OPENAI_API_KEY": key}, timeout=60)
            cpu0 = time.process_time()
            ran = await sb.run_bridged(argv, env={"OPENAI_API_KEY": key}, timeout=600)
            cpu = time.process_time() - cpu0
    finally:
        endpoint.close_episode(key)
    if not ran.ok:
        raise RuntimeError(f"the sandboxed agent failed: {ran}")
    return cpu / calls * 1e6, float(json.loads(ran.stdout)["p50_ms"])


async def measure_sandbox_agent(ctx: EpisodeContext, calls: int) -> dict[str, Any]:
    """The sandboxed agent's worker CPU and latency per call against the in-process one."""
    backend = _backend()
    if backend is None:
        return {"sandbox_agent": None}
    endpoint = AgentEndpoint(ctx.codec, ctx.client)
    await endpoint.start()
    body = orjson.dumps({"model": "policy", "messages": MESSAGES, "max_tokens": 8})
    try:
        await _in_process(endpoint, body, min(calls, 20))  # warm-up: connections, caches
        in_cpu, in_ms = await _in_process(endpoint, body, calls)
        sbx_cpu, sbx_ms = await _in_sandbox(endpoint, body, calls, backend)
    finally:
        await endpoint.close()
    return {
        "sandbox_agent": {
            "backend": backend,
            "calls": calls,
            "worker_cpu_us_per_call": sbx_cpu,
            "in_process_cpu_us_per_call": in_cpu,
            "p50_ms": sbx_ms,
            "in_process_p50_ms": in_ms,
        }
    }
