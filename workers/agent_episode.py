"""One episode of an `agent` environment: the user's function against the worker's endpoint.

The episode opens a key on the process's `AgentEndpoint`, calls the user's async function with
the task and an `OpenAIConfig` (plus the sandbox pool when the spec asks), or runs the user's
program in a sandbox session bridged to the endpoint (`workers.agent_command`), and turns the record
the endpoint kept into a `Trajectory`: the reward goes on the last turn, a limit a call ran
into makes the episode `truncated` (whatever the agent did with the error), an inference
failure is category `inference` and anything else the agent raised is `env` (neither is the
model's failure). The key expires when the episode ends, whatever happened.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import importlib.util
import logging
import math
import time
from collections.abc import Callable
from typing import Any

from broker.messages import ErrorCategory, FinishReason, Task, Trajectory, Truncation
from envs.agent import AgentEnv, OpenAIConfig
from envs.errors import EnvInfraError, EnvSpecError
from envs.sandboxed import SandboxPool
from workers import metrics
from workers.agent_command import run_in_sandbox
from workers.agent_endpoint import AgentEndpoint, SamplingDefaults
from workers.agent_record import AgentLimits, EpisodeRecord
from workers.config import EpisodeSettings

log = logging.getLogger(__name__)


class AgentResultError(Exception):
    """The agent returned something that is not a reward."""


def limits_for(env: AgentEnv, cfg: EpisodeSettings) -> AgentLimits:
    spec = env.config
    return AgentLimits(
        max_calls=spec.max_calls,
        max_completion_tokens=spec.max_completion_tokens,
        max_context_tokens=spec.max_context_tokens or cfg.max_context_tokens,
        wall_time_s=spec.wall_time_s or cfg.episode_timeout_s,
    )


async def run_agent_episode(
    endpoint: AgentEndpoint | None,
    sandbox: SandboxPool | None,
    cfg: EpisodeSettings,
    task: Task,
    index: int,
    *,
    env: AgentEnv,
) -> Trajectory:
    """Run episode `index` of an agent task; never raises for the agent's or inference's faults."""
    if endpoint is None:
        raise EnvSpecError("agent environments need the worker's agent endpoint")
    if (env.config.use_sandbox or env.in_sandbox) and sandbox is None:
        raise EnvSpecError("this agent asks for a sandbox; start the worker with --sandbox-backend")
    limits = limits_for(env, cfg)
    record = EpisodeRecord(limits, task.policy_version)
    session = f"{task.task_id}/{index}"
    seed_base = task.sampling_seed(index, 0) if cfg.sampling_seeds else None
    defaults = SamplingDefaults(
        cfg.temperature, cfg.top_p, cfg.max_tokens, cfg.top_k, cfg.min_p, seed_base
    )
    key = endpoint.open_episode(record, session, defaults)
    # The group's one seed: it picks the problem, so every episode of the group gets the same.
    openai = OpenAIConfig(
        endpoint.base_url, key, endpoint.model_name, task.seed, _in_process(endpoint)
    )
    extra = {"sandbox": sandbox} if env.config.use_sandbox else {}
    started = time.monotonic()
    reward, agent_metrics = 0.0, {}
    error, detail, timed_out = ErrorCategory.NONE, "", False
    metrics.EPISODES_IN_FLIGHT.inc()
    try:
        if env.in_sandbox:  # the sandbox bounds the program's time, the setup's and the check's
            result = await run_in_sandbox(
                endpoint, sandbox, env, key, seed=task.seed, limits=limits
            )
        else:
            async with asyncio.timeout(limits.wall_time_s):
                result = await env.function(env.config.task, openai, **extra)
        reward, agent_metrics = _reward(result)
    except asyncio.CancelledError:
        raise
    except TimeoutError:
        timed_out = True
    except EnvInfraError as exc:  # the sandbox failed: not the model's doing
        error, detail = exc.category, str(exc)[:500]
    except Exception as exc:  # the agent's failure is data on the trajectory (STYLE 7)
        error, detail = ErrorCategory.ENV, f"{type(exc).__name__}: {exc}"[:500]
    finally:
        metrics.EPISODES_IN_FLIGHT.dec()
        endpoint.close_episode(key)
    if record.failure is not None:
        error = ErrorCategory.INFERENCE
        detail = f"{type(record.failure).__name__}: {record.failure}"[:500]
    return _trajectory(
        record,
        index,
        reward,
        agent_metrics,
        error=error,
        detail=detail,
        timed_out=timed_out,
        started=started,
    )


def _in_process(endpoint: AgentEndpoint) -> Callable[[], Any] | None:
    """The agent's in-process client factory: no HTTP hop (None without httpx, which comes
    with the `openai` SDK: an agent without it reaches the endpoint over `base_url`)."""
    if importlib.util.find_spec("httpx") is None:
        return None
    from workers.agent_transport import in_process_client

    return functools.partial(in_process_client, endpoint)


def _reward(result: Any) -> tuple[float, dict[str, float]]:
    if isinstance(result, dict):
        if "reward" not in result:
            raise AgentResultError(f"the agent's dict has no 'reward': {sorted(result)}")
        found = result.get("metrics") or {}
        if not isinstance(found, dict):
            raise AgentResultError("the agent's 'metrics' must be a dict of numbers")
        return _number(result["reward"]), {str(k): _number(v) for k, v in found.items()}
    return _number(result), {}


def _number(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise AgentResultError(f"the agent returned {value!r}, not a finite number")
    return float(value)


def _trajectory(
    record: EpisodeRecord,
    index: int,
    reward: float,
    agent_metrics: dict[str, float],
    *,
    error: ErrorCategory,
    detail: str,
    timed_out: bool,
    started: float,
) -> Trajectory:
    turns = list(record.turns)
    truncation = record.truncation
    if timed_out and error is ErrorCategory.NONE:
        if turns:
            truncation = truncation or Truncation.WALL_TIME
        else:
            error, detail = ErrorCategory.TIMEOUT, "the agent made no call within its time"
    if error is not ErrorCategory.NONE:
        finish: FinishReason = FinishReason.ERROR
        truncation = None
        metrics.ERRORS.labels(category=error.value).inc()
        log.info("agent episode %d ended by %s: %s", index, error.value, detail)
    elif truncation is not None:
        finish = FinishReason.TRUNCATED
    else:
        finish = FinishReason.TERMINATED
    if turns:
        last = turns[-1]
        turns[-1] = dataclasses.replace(
            last,
            reward=reward,
            terminated=finish is FinishReason.TERMINATED,
            truncated=finish is FinishReason.TRUNCATED,
        )
    trajectory = Trajectory(
        turns=tuple(turns),
        finish_reason=finish,
        truncation=truncation,
        error=error,
        error_detail=detail,
        sample_index=index,
        timings={
            "inference": record.inference_s,
            "total": time.monotonic() - started,
            "segments": float(record.segments),
            **{f"agent/{k}": v for k, v in agent_metrics.items()},
        },
    )
    label = error.value if finish is FinishReason.ERROR else trajectory.outcome
    metrics.episodes("agent", label).inc()
    return trajectory
