"""One episode of an `agent` program in the sandbox: its session, its bridge, its check.

The episode opens a sandbox session whose bridge is the worker's agent endpoint
(`AgentEndpoint.serve_unix`), runs the task's setup in the session's shell, copies the
spec's files into the work dir and runs the program through the session's relay
(`sandbox.Session.run_bridged`), with this episode's key as ``OPENAI_API_KEY``: the
program reaches the endpoint over the session's own loopback and nothing else, and only
this session reaches that socket. When the program exits, the task's check runs in the
same session: reward 1.0 when it exits 0. A program that runs past its time is a
timeout (`TimeoutError`); a failure of the sandbox, or of the task's own setup, is
`EnvInfraError` (category sandbox), never the model's failure.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from broker.messages import ErrorCategory
from envs.agent import AgentEnv
from envs.errors import EnvInfraError
from envs.terminal import CHECK_TIMEOUT_S, SHELL_TIMEOUT_S
from workers.agent_endpoint import AgentEndpoint
from workers.agent_record import AgentLimits

if TYPE_CHECKING:  # the workers import the sandbox only where a pool is configured
    from sandbox import SandboxPool


async def run_in_sandbox(
    endpoint: AgentEndpoint,
    pool: SandboxPool,
    env: AgentEnv,
    key: str,
    *,
    seed: int,
    limits: AgentLimits,
) -> dict[str, Any]:
    """The program's episode; ``{"reward", "metrics"}`` as an agent function returns it."""
    from sandbox import SandboxError, Violation
    from sandbox.config import MAX_TIMEOUT_S

    task = env.pick(seed)
    assert env.config.command is not None
    try:
        async with pool.session(bridge=endpoint.serve_unix) as sb:
            setup = await sb.shell(task.setup, timeout=SHELL_TIMEOUT_S)
            if not setup.ok:
                raise EnvInfraError(f"setup of {task.name} failed: {setup}", ErrorCategory.SANDBOX)
            for path, data in env.files:
                await sb.write_file(path, data)
            program_env = {
                "OPENAI_API_KEY": key,
                "OPENAI_MODEL": endpoint.model_name,
                "FARM_PROMPT": task.prompt,
            }
            wall_s = min(limits.wall_time_s, MAX_TIMEOUT_S)
            ran = await sb.run_bridged(env.config.command, env=program_env, timeout=wall_s)
            if ran.violation is Violation.TIMEOUT:
                raise TimeoutError(f"the program ran past {wall_s}s")
            check = await sb.run(["bash", "-c", task.check], timeout=CHECK_TIMEOUT_S)
    except SandboxError as exc:
        raise EnvInfraError(f"sandbox failed: {exc}", ErrorCategory.SANDBOX) from exc
    solved = check.exit_code == 0
    exit_code = ran.exit_code if ran.exit_code is not None else -1
    return {
        "reward": 1.0 if solved else 0.0,
        "metrics": {"exit_code": float(exit_code), "solved": float(solved)},
    }
