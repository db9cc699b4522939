"""One episode: reset the env, then generate → parse → step until a limit or the end.

Invariants:
- `run_episode` never raises for a failure of the model, the environment, the sandbox or
  inference: it returns a `Trajectory` whose `finish_reason`/`error` say what happened
  (only cancellation and `EnvSpecError`, a task that cannot run at all, propagate).
  Whether to retry is decided by the caller (`group`).
- after `terminated` or `truncated` the loop returns: the env is never stepped again
  (`envs.astep` would refuse with `EnvStateError` anyway);
- Token bookkeeping is exact (see `workers.tokens`): the concatenation of every turn's
  `prompt_ids + completion_ids` is exactly what the model was sent and produced.
- Memory per episode is bounded by `max_context_tokens`: the episode holds its token
  ids and turns, never the rendered conversation text.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

import envs
from broker.messages import ErrorCategory, Task, Trajectory, Turn
from workers import metrics
from workers.errors import categorize
from workers.tokens import ChatCodec

log = logging.getLogger(__name__)


class Generator(Protocol):
    """What an episode needs from inference (`inference.client.GenerationClient`)."""

    async def generate(self, prompt_ids: Any, params: Any, *, session_id: str) -> Any: ...


@dataclass(frozen=True)
class EpisodeSettings:
    """Limits and sampling shared by every episode a worker runs."""

    max_tokens: int = 256  # completion tokens per turn (further capped by the context left)
    temperature: float = 1.0
    top_p: float = 1.0
    max_context_tokens: int = 4096  # prompt + completion tokens of the whole episode
    episode_timeout_s: float = 600.0  # wall clock of the whole episode
    env_step_timeout_s: float | None = None  # one reset or step (None: the episode limit only)


@dataclass
class _State:
    """Mutable bookkeeping of one running episode."""

    turns: list[Turn] = field(default_factory=list)
    phase: str = "start"  # "env" while the environment works: a timeout there is a hang
    timeout: asyncio.Timeout | None = None  # the episode's one timer, moved for env calls
    deadline: float = 0.0  # loop time at which the episode's wall-time limit expires
    inference_s: float = 0.0
    env_s: float = 0.0


@dataclass(frozen=True)
class EpisodeContext:
    """What one episode needs besides its settings."""

    codec: ChatCodec
    client: Generator
    sampling: Any  # inference.client.SamplingParams class (kept injectable for benchmarks)
    sandbox: Any = None  # SandboxPool for envs that take one


async def run_episode(
    ctx: EpisodeContext, cfg: EpisodeSettings, task: Task, index: int, max_turns: int
) -> Trajectory:
    """Run episode `index` of `task` (seed task.seed + index); return its trajectory."""
    state = _State()
    started = time.monotonic()
    env_name = task.env_spec.split("@", 1)[0]
    env: Any = None
    finish, error, detail = "error", ErrorCategory.NONE, ""
    metrics.EPISODES_IN_FLIGHT.inc()
    try:
        env = envs.make(task.env_spec, sandbox=ctx.sandbox)
        # One timer per episode: its deadline is pulled in to the step limit around each
        # env call and put back after (cheaper than a timer per call at 10k episodes).
        state.deadline = asyncio.get_running_loop().time() + cfg.episode_timeout_s
        async with asyncio.timeout_at(state.deadline) as state.timeout:
            finish = await _loop(ctx, cfg, task, index, max_turns, env, env_name, state)
    except TimeoutError as exc:
        if state.phase == "env" or not state.turns:
            error, detail = ErrorCategory.TIMEOUT, f"{state.phase} exceeded the time limit"
        else:
            finish = "truncated:wall_time"
            _mark_truncated(state)
        exc.__traceback__ = None
    except (asyncio.CancelledError, envs.EnvSpecError):
        raise  # a bad spec is the task's fault, not an episode outcome: the worker dead-letters it
    except Exception as exc:  # any failure becomes data on the trajectory (STYLE 7)
        error, detail = categorize(exc), f"{type(exc).__name__}: {exc}"[:500]
        log.info("episode %s/%d ended by %s", task.task_id, index, detail)
    finally:
        metrics.EPISODES_IN_FLIGHT.dec()
        if env is not None:
            await _close(env, cfg.env_step_timeout_s or 30.0)
    if error is not ErrorCategory.NONE:
        finish = "error"
        metrics.ERRORS.labels(category=error.value).inc()
    metrics.episodes(env_name, error.value if finish == "error" else finish).inc()
    timings = {
        "inference": state.inference_s,
        "env": state.env_s,
        "total": time.monotonic() - started,
    }
    return Trajectory(
        turns=tuple(state.turns),
        finish_reason=finish,
        error=error,
        error_detail=detail,
        sample_index=index,
        timings=timings,
    )


async def _loop(
    ctx: EpisodeContext,
    cfg: EpisodeSettings,
    task: Task,
    index: int,
    max_turns: int,
    env: Any,
    env_name: str,
    state: _State,
) -> str:
    """The turn loop; returns the finish reason."""
    obs, _ = await _env_call(
        state, cfg, envs.areset(env, seed=task.seed + index), ctx.sandbox is not None
    )
    prompt = ctx.codec.initial_prompt(
        obs, getattr(env, "system_prompt", None), getattr(env, "tools", None)
    )
    params = ctx.sampling(
        max_tokens=cfg.max_tokens,
        temperature=cfg.temperature,
        top_p=cfg.top_p,
        stop_token_ids=tuple(ctx.codec.stop_token_ids),
        allowed_token_ids=ctx.codec.allowed_token_ids(getattr(env, "action_vocabulary", None)),
    )
    session = f"{task.task_id}/{index}"
    try:
        return await _turns(
            ctx, cfg, task, max_turns, env, env_name, state, prompt, params, session
        )
    finally:
        end_session = getattr(ctx.client, "end_session", None)
        if end_session is not None:
            end_session(session)  # the sticky-server entry must not outlive the episode


async def _turns(
    ctx: EpisodeContext,
    cfg: EpisodeSettings,
    task: Task,
    max_turns: int,
    env: Any,
    env_name: str,
    state: _State,
    prompt: list[int],
    params: Any,
    session: str,
) -> str:
    context: list[int] = list(prompt)
    env_steps = metrics.env_steps(env_name)
    while True:
        room = cfg.max_context_tokens - len(context)
        if room <= 0:
            return "truncated:context"
        state.phase = "inference"
        t0 = time.monotonic()
        gen = await ctx.client.generate(
            context, _with_max_tokens(params, min(cfg.max_tokens, room)), session_id=session
        )
        state.inference_s += time.monotonic() - t0
        metrics.INFERENCE_LATENCY.observe(time.monotonic() - t0)
        metrics.TOKENS_GENERATED.inc(len(gen.token_ids))
        action = ctx.codec.decode(gen.token_ids)
        obs, reward, terminated, truncated, info = await _env_call(
            state, cfg, envs.astep(env, action), ctx.sandbox is not None
        )
        env_steps.inc()
        if info.get("error") == ErrorCategory.FORMAT:
            metrics.ERRORS.labels(category=ErrorCategory.FORMAT.value).inc()
        versions = [v for v in gen.weight_versions if v >= 0]  # -1: a non-integer label
        state.turns.append(
            Turn(
                prompt_ids=prompt,
                completion_ids=gen.token_ids,
                logprobs=gen.logprobs,
                weight_version=min(versions) if len(versions) else task.policy_version,
                reward=reward,
                terminated=terminated,
                truncated=False,
                temperature=params.temperature,  # what the logprobs were computed under
            )
        )
        if terminated:
            return "terminated"
        if truncated:
            return _mark_truncated(state, "truncated:env")
        if len(state.turns) >= max_turns:
            return _mark_truncated(state, "truncated:max_turns")
        prompt = ctx.codec.next_prompt(gen.token_ids, obs)
        if len(context) + len(gen.token_ids) + len(prompt) >= cfg.max_context_tokens:
            return _mark_truncated(state, "truncated:context")
        context.extend(gen.token_ids)
        context.extend(prompt)


async def _env_call(state: _State, cfg: EpisodeSettings, call: Any, sandboxed: bool) -> Any:
    """Await one env reset/step under the step limit (and the episode's), timing it."""
    state.phase = "env"
    t0 = time.monotonic()
    step_limit = cfg.env_step_timeout_s
    if step_limit is not None and state.timeout is not None:
        step_deadline = asyncio.get_running_loop().time() + step_limit
        if step_deadline < state.deadline:
            state.timeout.reschedule(step_deadline)
        else:
            step_limit = None  # the episode's deadline comes first: nothing to move
    try:
        result = await call
    finally:
        elapsed = time.monotonic() - t0
        state.env_s += elapsed
        metrics.ENV_STEP_SECONDS.observe(elapsed)
        if sandboxed:
            metrics.SANDBOX_SECONDS.observe(elapsed)
    if step_limit is not None and state.timeout is not None:
        state.timeout.reschedule(state.deadline)
    state.phase = "agent"
    return result


def _with_max_tokens(params: Any, max_tokens: int) -> Any:
    if params.max_tokens == max_tokens:
        return params
    return dataclasses.replace(params, max_tokens=max_tokens)


def _mark_truncated(state: _State, reason: str = "truncated:wall_time") -> str:
    if state.turns:
        state.turns[-1] = dataclasses.replace(state.turns[-1], truncated=True)
    return reason


async def _close(env: Any, timeout_s: float) -> None:
    """Close the env; a close that fails or hangs is logged, never raised."""
    try:
        await envs.aclose(env, timeout_s)
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # a broken close must not spoil a finished episode
        log.warning("closing env failed: %s: %s", type(exc).__name__, exc)
