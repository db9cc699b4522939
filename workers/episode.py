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
from collections.abc import Awaitable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, runtime_checkable

import envs
from broker.messages import (
    ErrorCategory,
    FinishReason,
    Sampling,
    Task,
    Trajectory,
    Truncation,
    Turn,
)
from inference.client import Generator, SamplingParams
from workers import metrics
from workers.agent_endpoint import AgentEndpoint
from workers.agent_episode import run_agent_episode
from workers.answers import AnswerReader
from workers.config import EpisodeSettings
from workers.errors import categorize
from workers.tokens import ChatCodec
from workers.transcript import History, Transcript

if TYPE_CHECKING:
    from sandbox import SandboxPool

log = logging.getLogger(__name__)
T = TypeVar("T")


@runtime_checkable
class ChatEnv(Protocol):
    """The chat metadata an environment declares (`envs.Env` and wrappers of one do)."""

    system_prompt: str | None
    tools: list[dict[str, Any]] | None
    action_vocabulary: tuple[str, ...] | None


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
    """What every episode of a worker shares: tokenizer, inference, sampling, sandbox."""

    codec: ChatCodec
    client: Generator
    sampling: type[SamplingParams]  # kept injectable for benchmarks
    sandbox: SandboxPool | None = None  # for envs that take one
    agents: AgentEndpoint | None = None  # the process's endpoint for `agent` envs
    reader: AnswerReader = None  # type: ignore[assignment]  # reasoning and tool parsers; default: none and auto
    history: History = "keep"  # how earlier turns are carried (workers.transcript)

    def __post_init__(self) -> None:
        if self.reader is None:
            object.__setattr__(self, "reader", AnswerReader(self.codec))


@dataclass
class _Episode:
    """One running episode: what it was given, its environment, and its bookkeeping."""

    ctx: EpisodeContext
    cfg: EpisodeSettings
    task: Task
    index: int  # within the group: it picks the episode's sampling seeds (the prompt is shared)
    max_turns: int
    env_name: str
    env: Any = None  # built by envs.make; Gymnasium-shaped, sync or async
    state: _State = field(default_factory=_State)

    @property
    def session(self) -> str:
        return f"{self.task.task_id}/{self.index}"

    @property
    def sandboxed(self) -> bool:
        return self.ctx.sandbox is not None


# (finish reason, truncation cause); the cause only with TRUNCATED
Ending = tuple[FinishReason, Truncation | None]


async def run_episode(
    ctx: EpisodeContext, cfg: EpisodeSettings, task: Task, index: int, max_turns: int
) -> Trajectory:
    """Run episode `index` of `task` (reset with task.seed, as every episode of the group, so
    they share one prompt; sampled with seeds of its own); return its trajectory."""
    ep = _Episode(ctx, cfg, task, index, max_turns, task.env_spec.split("@", 1)[0])
    if ep.env_name == "agent":  # a user's agent program: it drives, the endpoint records
        env = envs.make(task.env_spec)
        return await run_agent_episode(ctx.agents, ctx.sandbox, cfg, task, index, env=env)
    state = ep.state
    started = time.monotonic()
    ending: Ending = (FinishReason.ERROR, None)
    error, detail = ErrorCategory.NONE, ""
    metrics.EPISODES_IN_FLIGHT.inc()
    try:
        ep.env = envs.make(task.env_spec, sandbox=ctx.sandbox)
        # One timer per episode: its deadline is pulled in to the step limit around each
        # env call and put back after (cheaper than a timer per call at 10k episodes).
        state.deadline = asyncio.get_running_loop().time() + cfg.episode_timeout_s
        async with asyncio.timeout_at(state.deadline) as state.timeout:
            ending = await _loop(ep)
    except TimeoutError as exc:
        if state.phase == "env" or not state.turns:
            error, detail = ErrorCategory.TIMEOUT, f"{state.phase} exceeded the time limit"
        else:
            ending = _mark_truncated(state, Truncation.WALL_TIME)
        exc.__traceback__ = None
    except (asyncio.CancelledError, envs.EnvSpecError):
        raise  # a bad spec is the task's fault, not an episode outcome: the worker dead-letters it
    except Exception as exc:  # any failure becomes data on the trajectory (STYLE 7)
        error, detail = categorize(exc), f"{type(exc).__name__}: {exc}"[:500]
        log.info("episode %s ended by %s", ep.session, detail)
    finally:
        metrics.EPISODES_IN_FLIGHT.dec()
        if ep.env is not None:
            await _close(ep.env, cfg.env_step_timeout_s or 30.0)
    if error is not ErrorCategory.NONE:
        ending = (FinishReason.ERROR, None)
        metrics.ERRORS.labels(category=error.value).inc()
    trajectory = Trajectory(
        turns=tuple(state.turns),
        finish_reason=ending[0],
        truncation=ending[1],
        error=error,
        error_detail=detail,
        sample_index=index,
        timings={
            "inference": state.inference_s,
            "env": state.env_s,
            "total": time.monotonic() - started,
        },
    )
    label = error.value if ending[0] is FinishReason.ERROR else trajectory.outcome
    metrics.episodes(ep.env_name, label).inc()
    return trajectory


async def _loop(ep: _Episode) -> Ending:
    """Reset, then the turn loop; returns how the episode ended."""
    ctx, cfg = ep.ctx, ep.cfg
    row = ep.task.row  # a dataset row reaches the env as Gymnasium's reset options
    options = None if row is None else {"row": row}
    obs, _ = await _env_call(ep, envs.areset(ep.env, seed=ep.task.seed, options=options))
    chat: ChatEnv = ep.env if _declares_chat(ep.env) else _NoChat()
    transcript = Transcript(ctx.codec, ctx.history, chat.system_prompt, chat.tools)
    transcript.first(obs)
    task = ep.task  # an eval task may set its own temperature and max tokens
    params = ctx.sampling(
        max_tokens=cfg.max_tokens if task.max_tokens is None else task.max_tokens,
        temperature=cfg.temperature if task.temperature is None else task.temperature,
        top_p=cfg.top_p,
        top_k=cfg.top_k,
        min_p=cfg.min_p,
        stop_token_ids=tuple(ctx.codec.stop_token_ids),
    )
    try:
        return await _turns(ep, chat, transcript, params)
    finally:
        ctx.client.end_session(ep.session)  # the sticky-server entry must not outlive it


_CHAT_ATTRS = tuple(ChatEnv.__annotations__)  # its members: system_prompt, tools, ...


def _declares_chat(env: Any) -> bool:
    """`isinstance(env, ChatEnv)`, as a runtime-checkable protocol of data members checks it
    (every member present), without its per-call cost (~20 µs on Python 3.11)."""
    return all(hasattr(env, name) for name in _CHAT_ATTRS)


class _NoChat:
    """An environment that declares no chat metadata."""

    system_prompt = None
    tools = None
    action_vocabulary = None


async def _turns(
    ep: _Episode, chat: ChatEnv, transcript: Transcript, params: SamplingParams
) -> Ending:
    ctx, cfg, state = ep.ctx, ep.cfg, ep.state
    prompt, segment = list(transcript.context), False
    reader = ctx.reader
    env_steps = metrics.env_steps(ep.env_name)
    by_vocabulary: dict[tuple[str, ...] | None, tuple[SamplingParams, Sampling]] = {}
    while True:
        # read before every turn: an environment may narrow its actions by phase (lookup's
        # protocol allows only the tool call first), and the turn records what was allowed
        vocabulary = chat.action_vocabulary
        if vocabulary not in by_vocabulary:
            narrowed = dataclasses.replace(
                params, allowed_token_ids=ctx.codec.allowed_token_ids(vocabulary)
            )
            by_vocabulary[vocabulary] = (narrowed, narrowed.distribution())
        params, sampling = by_vocabulary[vocabulary]
        room = cfg.max_context_tokens - len(transcript.context)
        if room <= 0:
            return (FinishReason.TRUNCATED, Truncation.CONTEXT)
        state.phase = "inference"
        t0 = time.monotonic()
        seed = ep.task.sampling_seed(ep.index, len(state.turns)) if cfg.sampling_seeds else None
        call = dataclasses.replace(params, max_tokens=min(params.max_tokens, room), seed=seed)
        gen = await ctx.client.generate(transcript.context, call, session_id=ep.session)
        state.inference_s += time.monotonic() - t0
        metrics.INFERENCE_LATENCY.observe(time.monotonic() - t0)
        metrics.TOKENS_GENERATED.inc(len(gen.token_ids))
        answer = reader.read(gen.token_ids)
        step = envs.astep(ep.env, answer.action)
        obs, reward, terminated, truncated, info = await _env_call(ep, step)
        env_steps.inc()
        if info.get("error") == ErrorCategory.FORMAT:
            metrics.ERRORS.labels(category=ErrorCategory.FORMAT.value).inc()
        if "reward_components" in info:  # a reward function's named parts (envs.rewards)
            metrics.observe_reward_components(ep.env_name, info["reward_components"])
        versions = [v for v in gen.weight_versions if v >= 0]  # -1: a non-integer label
        state.turns.append(
            Turn(
                prompt_ids=prompt,
                completion_ids=gen.token_ids,
                logprobs=gen.logprobs,
                weight_version=min(versions) if len(versions) else ep.task.policy_version,
                reward=reward,
                terminated=terminated,
                truncated=False,
                segment_start=segment,
                sampling=sampling,
                cut=gen.finish_reason == "length",
                reasoning_tokens=answer.reasoning_tokens,
            )
        )
        if terminated:
            return (FinishReason.TERMINATED, None)
        if truncated:
            return _mark_truncated(state, Truncation.ENV)
        if len(state.turns) >= ep.max_turns:
            return _mark_truncated(state, Truncation.MAX_TURNS)
        prompt, segment = transcript.next(gen.token_ids, str(answer.action), obs)
        if len(transcript.context) >= cfg.max_context_tokens:
            return _mark_truncated(state, Truncation.CONTEXT)


async def _env_call(ep: _Episode, call: Awaitable[T]) -> T:
    """Await one env reset/step under the step limit (and the episode's), timing it."""
    state = ep.state
    state.phase = "env"
    t0 = time.monotonic()
    step_limit = ep.cfg.env_step_timeout_s
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
        if ep.sandboxed:
            metrics.SANDBOX_SECONDS.observe(elapsed)
    if step_limit is not None and state.timeout is not None:
        state.timeout.reschedule(state.deadline)
    state.phase = "agent"
    return result


def _mark_truncated(state: _State, cause: Truncation) -> Ending:
    if state.turns:
        state.turns[-1] = dataclasses.replace(state.turns[-1], truncated=True)
    return (FinishReason.TRUNCATED, cause)


async def _close(env: Any, timeout_s: float) -> None:
    """Close the env; a close that fails or hangs is logged, never raised."""
    try:
        await envs.aclose(env, timeout_s)
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # a broken close must not spoil a finished episode
        log.warning("closing env failed: %s: %s", type(exc).__name__, exc)
