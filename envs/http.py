"""``HTTPEnv``: an environment served by an external HTTP environment server.

The protocol is AgentGym's: ``POST /create`` returns an environment id (a bare
integer or ``{"id": ...}``); ``POST /reset {"id", "data_idx"}`` starts an episode
(``data_idx`` is the seed, i.e. the task index); ``GET /observation?id=`` returns
the observation; ``POST /step {"id", "action"}`` returns ``{"observation",
"reward", "done"}`` (plus optional ``"truncated"`` and ``"info"``);
``POST /close {"id"}`` frees it. Paths and the id field are configurable.

Every request has a timeout. Transient failures (connection errors, timeouts,
5xx) are retried with backoff within a total budget — except that ``step`` is
not idempotent, so it is retried only when the request never reached the server
(connection refused) or the server answered 503. Anything else, and a malformed
reply, becomes ``EnvInfraError(category=ENV)``: the server failed, not the model.
"""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import pydantic

from broker.messages import ErrorCategory
from envs.api import ResetResult, StepResult
from envs.errors import EnvInfraError, EnvStateError
from envs.registry import spec_config


class HTTPEnvConfig(pydantic.BaseModel):
    """Where the environment server is and how patiently to talk to it."""

    model_config = pydantic.ConfigDict(extra="forbid", frozen=True)

    url: str = pydantic.Field(
        description="base URL of the environment server, e.g. http://host:8000"
    )
    create_path: str = pydantic.Field("/create", description="POST: create an environment")
    reset_path: str = pydantic.Field("/reset", description="POST: reset it to a task")
    step_path: str = pydantic.Field("/step", description="POST: apply an action")
    observation_path: str = pydantic.Field("/observation", description="GET: current observation")
    close_path: str = pydantic.Field("/close", description="POST: free it ('' = no close call)")
    id_field: str = pydantic.Field("id", description="name of the environment-id field")
    timeout_s: float = pydantic.Field(30.0, gt=0, le=600, description="per-request timeout")
    retries: int = pydantic.Field(3, ge=0, le=20, description="retries of a transient failure")
    backoff_s: float = pydantic.Field(0.2, ge=0, le=30, description="first retry delay (doubles)")
    retry_budget_s: float = pydantic.Field(60.0, gt=0, description="cap on total time retrying")
    system_prompt: str | None = pydantic.Field(None, description="system message for the model")


class _Transient(Exception):
    """A failure worth retrying; carries whether the server may have acted on it."""

    def __init__(self, message: str, maybe_applied: bool) -> None:
        super().__init__(message)
        self.maybe_applied = maybe_applied


class HTTPEnv:
    """Async environment that proxies reset/step to a remote server."""

    tools: list[dict[str, Any]] | None = None
    action_vocabulary: tuple[str, ...] | None = None

    def __init__(self, config: HTTPEnvConfig) -> None:
        self.config = config
        self.system_prompt = config.system_prompt
        self._session: aiohttp.ClientSession | None = None
        self._env_id: Any = None
        self._closed = False

    async def _once(self, method: str, path: str, payload: dict[str, Any] | None) -> Any:
        assert self._session is not None
        url = self.config.url.rstrip("/") + path
        timeout = aiohttp.ClientTimeout(total=self.config.timeout_s)
        kwargs: dict[str, Any] = {"params": payload} if method == "GET" else {"json": payload}
        try:
            async with self._session.request(method, url, timeout=timeout, **kwargs) as resp:
                if resp.status >= 500:
                    raise _Transient(f"{method} {path}: HTTP {resp.status}", resp.status != 503)
                if resp.status >= 400:
                    text = (await resp.text())[:200]
                    raise EnvInfraError(
                        f"{method} {path}: HTTP {resp.status}: {text}", ErrorCategory.ENV
                    )
                return await resp.json(content_type=None)
        except aiohttp.ClientConnectorError as exc:
            raise _Transient(f"{method} {path}: cannot connect: {exc}", False) from exc
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise _Transient(f"{method} {path}: {type(exc).__name__}: {exc}", True) from exc
        except ValueError as exc:  # undecodable JSON body
            raise EnvInfraError(
                f"{method} {path}: reply is not JSON: {exc}", ErrorCategory.ENV
            ) from exc

    async def _request(
        self, method: str, path: str, payload: dict[str, Any] | None, *, idempotent: bool
    ) -> Any:
        if self._closed:
            raise EnvStateError("HTTPEnv used after aclose()")
        if self._session is None:
            self._session = aiohttp.ClientSession()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.retry_budget_s
        delay = self.config.backoff_s
        for attempt in range(self.config.retries + 1):
            try:
                return await self._once(method, path, payload)
            except _Transient as exc:
                retryable = idempotent or not exc.maybe_applied
                out_of_time = loop.time() + delay > deadline
                if not retryable or attempt == self.config.retries or out_of_time:
                    raise EnvInfraError(
                        f"environment server failed after {attempt + 1} attempt(s): {exc}",
                        ErrorCategory.ENV,
                    ) from exc
            await asyncio.sleep(delay)
            delay *= 2
        raise AssertionError("unreachable")

    async def areset(self, seed: int | None = None) -> ResetResult:
        cfg = self.config
        if self._env_id is None:
            created = await self._request("POST", cfg.create_path, {}, idempotent=True)
            self._env_id = created.get(cfg.id_field) if isinstance(created, dict) else created
            if self._env_id is None or isinstance(self._env_id, (list, dict)):
                raise EnvInfraError(
                    f"create returned no usable id: {created!r:.200}", ErrorCategory.ENV
                )
        ident = {cfg.id_field: self._env_id}
        reply = await self._request(
            "POST", cfg.reset_path, {**ident, "data_idx": seed or 0}, idempotent=True
        )
        if isinstance(reply, dict) and "observation" in reply:
            observation = reply["observation"]
        else:
            observation = await self._request("GET", cfg.observation_path, ident, idempotent=True)
            if isinstance(observation, dict):
                observation = observation.get("observation", observation)
        return observation, {"env_id": self._env_id}

    async def astep(self, action: Any) -> StepResult:
        if self._env_id is None:
            raise EnvStateError("HTTPEnv: step() before reset()")
        payload = {self.config.id_field: self._env_id, "action": action}
        reply = await self._request("POST", self.config.step_path, payload, idempotent=False)
        try:
            observation = reply["observation"]
            reward = float(reply.get("reward", 0.0))
            terminated = bool(reply.get("done", reply.get("terminated", False)))
            truncated = bool(reply.get("truncated", False))
            info = dict(reply.get("info") or {})
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise EnvInfraError(
                f"malformed step reply {reply!r:.200}: {exc!r}", ErrorCategory.ENV
            ) from exc
        return observation, reward, terminated, truncated, info

    async def aclose(self) -> None:
        if self._closed:
            return
        try:
            if self._env_id is not None and self.config.close_path and self._session is not None:
                payload = {self.config.id_field: self._env_id}
                try:
                    await self._request("POST", self.config.close_path, payload, idempotent=True)
                except EnvInfraError:
                    pass  # best effort: a failed close must not fail an episode that already ended
        finally:
            self._closed = True
            if self._session is not None:
                await self._session.close()


@spec_config(HTTPEnvConfig)
def make_http_env(
    url: str,
    system_prompt: str | None = None,
    timeout_s: float = 30.0,
    retries: int = 3,
    **paths: Any,
) -> HTTPEnv:
    """Registry factory for ``http@{"url": ..., ...}``; other HTTPEnvConfig fields pass through."""
    return HTTPEnv(
        HTTPEnvConfig(
            url=url, system_prompt=system_prompt, timeout_s=timeout_s, retries=retries, **paths
        )
    )
