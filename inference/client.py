"""The generation client: token ids in, token ids + logprobs + weight versions out, over many servers.

Routing: a request with a `session_id` goes to the server that served that session before
(sticky, so a multi-turn episode reuses its server's prefix cache) while that server is healthy;
otherwise to the healthy server with the fewest outstanding requests. A connection error, a
timeout or a 5xx/408/429 marks the server unhealthy and the call moves to another server after a
capped exponential backoff, until `retry_budget_s` is spent (then `InferenceUnavailable`). A 4xx
is the request's fault and raises `InferenceRequestError` at once (`AdapterNotServed` when the
request named a LoRA adapter and the server answered 404: it was unloaded, or never loaded). A generation cut short by a
server pause in `abort` mode (finish reason `abort`) is continued with the tokens so far appended
to the prompt, so callers get whole generations whose per-token weight versions show the switch.
With `on_tokens`, `generate()` asks for a stream (`inference.completion_stream`) and hands each
event's token ids on as they arrive; tokens delivered before a server failed are kept, and the
next server continues after them, as after a pause. Cancelling `generate()` closes the HTTP
request, and the server aborts the sequence. A background
task checks `/health` on every server; `wait_healthy()` waits, within a limit, for the first
server to answer (a worker started beside a server that is still loading). Every network await
has a timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import orjson

from broker.messages import Sampling
from inference import metrics
from inference.completion_stream import StreamedCompletion, TokenSink
from inference.config import ClientConfig
from inference.errors import (
    AdapterNotServed,
    InferenceError,
    InferenceRequestError,
    InferenceUnavailable,
    error_excerpt,
)
from inference.http import HttpClient

__all__ = [
    "AdapterNotServed",
    "ClientConfig",
    "Generation",
    "GenerationClient",
    "InferenceRequestError",
    "InferenceUnavailable",
    "SamplingParams",
    "ServedAdapter",
]


@dataclass(frozen=True)
class SamplingParams:
    """Per-call sampling settings (vLLM field names)."""

    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    min_p: float = 0.0  # 0: off
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    allowed_token_ids: tuple[int, ...] | None = None  # restrict sampling to these ids

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError("max_tokens must be >= 1")
        if self.allowed_token_ids is not None and not self.allowed_token_ids:
            raise ValueError("allowed_token_ids must be None or non-empty")
        if self.temperature < 0:
            raise ValueError("temperature must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError("top_p must be in (0, 1]")
        if self.top_k < 0:
            raise ValueError("top_k must be >= 0 (0: off)")
        if not 0 <= self.min_p <= 1:
            raise ValueError("min_p must be in [0, 1]")

    def distribution(self) -> Sampling:
        """The distribution these settings sample from, as recorded on a turn."""
        if self.temperature == 0.0:  # greedy: vLLM resets the truncation
            return Sampling(self.temperature, allowed_token_ids=self.allowed_token_ids)
        return Sampling(
            self.temperature, self.top_k, self.top_p, self.min_p, self.allowed_token_ids
        )


@dataclass(frozen=True)
class ServedAdapter:
    """A LoRA adapter to generate with: its served name and the weight version it holds."""

    name: str  # the `model` of the request, `<run>-v<version>`
    version: int  # recorded on every token it generates


@dataclass(frozen=True)
class Generation:
    """One finished generation."""

    token_ids: list[int]  # sampled tokens, including a final stop/EOS token
    logprobs: list[
        float
    ]  # logprob of each token under the processed distribution it was drawn from
    weight_versions: list[int]  # weight version that sampled each token (-1: non-integer label)
    finish_reason: str  # "stop", "length" or "abort" (abort only once resumes are exhausted)
    server: str  # base URL of the server that produced the last part


class Generator(Protocol):
    """What an episode needs from inference: `GenerationClient`, or a stand-in for one."""

    async def generate(
        self, prompt_ids: Sequence[int], params: SamplingParams, *, session_id: str
    ) -> Generation: ...

    def end_session(self, session_id: str) -> None:
        """Forget the episode's sticky server."""


class StreamingGenerator(Generator, Protocol):
    """What the agent endpoint needs: a `Generator` that also hands token ids to `on_tokens`
    as they are generated (`GenerationClient`, the workers' `PolicyModel`)."""

    async def generate(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        *,
        session_id: str,
        on_tokens: TokenSink | None = None,
    ) -> Generation: ...


class _Retryable(Exception):
    """A failure of the server, not of the request: try another server."""

    def __init__(self, message: str, outcome: str = "error", status: int | None = None) -> None:
        super().__init__(message)
        self.outcome = outcome
        self.status = status  # the HTTP status when the server answered


@dataclass
class _Server:
    url: str
    healthy: bool = True
    outstanding: int = 0
    picks: int = 0

    def __post_init__(self) -> None:
        self.completions = self.url + "/v1/completions"
        # labels() costs a dict lookup under a lock: resolve this server's series once.
        self.latency = metrics.CLIENT_LATENCY.labels(server=self.url)
        self.requests = {
            o: metrics.CLIENT_REQUESTS.labels(server=self.url, outcome=o)
            for o in ("ok", "abort", "bad_request", "error", "timeout")
        }
        self.healthy_gauge = metrics.CLIENT_HEALTHY.labels(server=self.url)
        metrics.CLIENT_OUTSTANDING.labels(server=self.url).set_function(lambda: self.outstanding)


def expand_versions(spans: list[dict[str, Any]], count: int) -> list[int]:
    """vLLM weight-version spans -> one integer version per generated token."""
    out: list[int] = []
    for span in spans:
        label = str(span["version"])
        number = int(label) if label.lstrip("-").isdigit() else -1
        out.extend([number] * (int(span["end"]) - int(span["start"])))
    if len(out) != count:
        raise _Retryable(f"weight_versions cover {len(out)} tokens, expected {count}")
    return out


class GenerationClient:
    """Async client over several policy servers; `await start()` before use, `await close()` after."""

    def __init__(self, urls: Sequence[str], config: ClientConfig | None = None) -> None:
        if not urls:
            raise ValueError("at least one server URL is needed")
        self.config = config or ClientConfig()
        self._servers = {u.rstrip("/"): _Server(u.rstrip("/")) for u in urls}
        self._sticky: OrderedDict[str, str] = OrderedDict()
        self._http: HttpClient | None = None
        self._health_task: asyncio.Task[None] | None = None
        self._closed = False
        self._tiebreak = itertools.count()
        for server in self._servers.values():
            server.healthy_gauge.set(1)

    async def start(self) -> GenerationClient:
        if self._closed:
            raise InferenceError("client is closed")
        key = self.config.api_key
        headers = {"Authorization": f"Bearer {key.get_secret_value()}"} if key else {}
        self._http = HttpClient(
            limit=self.config.max_connections,
            connect_timeout_s=self.config.connect_timeout_s,
            headers=headers,
        )
        self._health_task = asyncio.create_task(self._health_loop(), name="inference-client-health")
        return self

    async def close(self) -> None:
        self._closed = True
        if self._health_task is not None:
            self._health_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._health_task
        if self._http is not None:
            await self._http.close()

    async def __aenter__(self) -> GenerationClient:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def end_session(self, session_id: str) -> None:
        """Forget a finished episode's sticky server."""
        self._sticky.pop(session_id, None)

    def session_server(self, session_id: str) -> str | None:
        return self._sticky.get(session_id)

    async def generate(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        session_id: str | None = None,
        adapter: ServedAdapter | None = None,
        on_tokens: TokenSink | None = None,
    ) -> Generation:
        """Generate from `prompt_ids`, with a LoRA `adapter` when given, streamed to
        `on_tokens` when given; raises InferenceUnavailable / InferenceRequestError
        (AdapterNotServed: no server knows it)."""
        if self._http is None or self._closed:
            raise InferenceError("client is not started (or already closed)")
        deadline = time.monotonic() + self.config.retry_budget_s
        tokens: list[int] = []
        logprobs: list[float] = []
        versions: list[int] = []
        resumes, delay, excluded = 0, self.config.backoff_initial_s, set[str]()
        last_error, last_status = "no attempt made", None
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise InferenceUnavailable(
                    f"no server answered within the retry budget: {last_error}", last_status
                )
            server = self._pick(session_id, excluded)
            prompt = [*prompt_ids, *tokens] if tokens else prompt_ids
            body = self._body(prompt, params, params.max_tokens - len(tokens), adapter)
            stream = StreamedCompletion(on_tokens) if on_tokens is not None else None
            if stream is not None:
                body["stream"] = True
            try:
                choice = await self._call(
                    server, body, min(self.config.request_timeout_s, remaining), stream
                )
            except InferenceRequestError as exc:
                if adapter is not None and exc.status == 404:
                    raise AdapterNotServed(adapter.name, exc.message) from None
                raise
            except _Retryable as exc:
                if stream is not None and stream.token_ids:  # the caller has them: keep them
                    tokens += stream.token_ids
                    logprobs += stream.logprobs
                    versions += _partial_versions(stream, adapter)
                    ended = tokens[-1] in params.stop_token_ids
                    if ended or len(tokens) >= params.max_tokens:
                        return Generation(
                            tokens, logprobs, versions, "stop" if ended else "length", server.url
                        )
                last_error, last_status = f"{server.url}: {exc}", exc.status
                self._mark_failed(server, session_id, excluded)
                await asyncio.sleep(min(delay, max(0.0, deadline - time.monotonic())))
                delay = min(delay * 2, self.config.backoff_max_s)
                continue
            if session_id is not None:
                self._pin(session_id, server.url)
            new = choice["token_ids"]
            tokens += new
            logprobs += choice["logprobs"]["token_logprobs"]
            spans = expand_versions(choice["weight_versions"], len(new))
            # vLLM labels every token with its one engine-wide version, whatever the adapter:
            # an adapter's tokens come from the version its name carries (never reloaded)
            versions += [adapter.version] * len(new) if adapter is not None else spans
            finish = choice["finish_reason"]
            if (
                finish == "abort"
                and resumes < self.config.max_abort_resumes
                and len(tokens) < params.max_tokens
            ):
                resumes += 1  # the server was paused mid-generation: continue where it stopped
                continue
            return Generation(tokens, logprobs, versions, finish, server.url)

    def _body(
        self,
        prompt: Sequence[int],
        params: SamplingParams,
        max_tokens: int,
        adapter: ServedAdapter | None = None,
    ) -> dict[str, Any]:
        body: dict[str, Any] = {
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": params.temperature,
            "top_p": params.top_p,
            "top_k": params.top_k,
            "min_p": params.min_p,
            # Sent at their neutral values: an omitted one would take vLLM's default from the
            # model's generation_config.json, a distribution the learner does not mirror.
            "repetition_penalty": 1.0,
            "presence_penalty": 0.0,
            "frequency_penalty": 0.0,
            "logprobs": 0,
            "return_token_ids": True,
            "return_weight_versions": True,
            "stop_token_ids": list(params.stop_token_ids),
        }
        if adapter is not None:
            body["model"] = adapter.name
        elif self.config.served_model_name is not None:
            body["model"] = self.config.served_model_name
        if params.seed is not None:
            body["seed"] = params.seed
        if params.allowed_token_ids is not None:
            body["allowed_token_ids"] = list(params.allowed_token_ids)
        return body

    def _pick(self, session_id: str | None, excluded: set[str]) -> _Server:
        if len(excluded) >= len(self._servers):
            excluded.clear()  # every server failed once: start another round over all of them
        pinned = self._sticky.get(session_id) if session_id is not None else None
        if pinned is not None and pinned not in excluded and self._servers[pinned].healthy:
            self._sticky.move_to_end(session_id)  # type: ignore[arg-type]
            return self._servers[pinned]
        open_ = [s for s in self._servers.values() if s.url not in excluded]
        candidates = [s for s in open_ if s.healthy] or open_
        server = min(candidates, key=lambda s: (s.outstanding, s.picks))
        server.picks = next(self._tiebreak)
        return server

    def _pin(self, session_id: str, url: str) -> None:
        self._sticky[session_id] = url
        self._sticky.move_to_end(session_id)
        while len(self._sticky) > self.config.max_sessions:
            self._sticky.popitem(last=False)

    def _mark_failed(self, server: _Server, session_id: str | None, excluded: set[str]) -> None:
        server.healthy = False
        server.healthy_gauge.set(0)
        excluded.add(server.url)
        if session_id is not None and self._sticky.get(session_id) == server.url:
            del self._sticky[session_id]

    async def _call(
        self,
        server: _Server,
        body: dict[str, Any],
        limit_s: float,
        stream: StreamedCompletion | None = None,
    ) -> dict[str, Any]:
        assert self._http is not None
        server.outstanding += 1
        started, outcome = time.monotonic(), "error"
        try:
            payload = orjson.dumps(body, option=orjson.OPT_SERIALIZE_NUMPY)
            sink = stream.feed if stream is not None else None
            resp = await self._http.request("POST", server.completions, payload, limit_s, sink)
            status = resp.status
            if status == 200:
                if stream is not None:
                    choice = _check_choice({"choices": [stream.choice()]})
                else:
                    choice = _check_choice(orjson.loads(resp.body) if resp.body else None)
                outcome = "abort" if choice["finish_reason"] == "abort" else "ok"
                return choice
            message = error_excerpt(resp.body)
            if 400 <= status < 500 and status not in (408, 429):
                outcome = "bad_request"
                raise InferenceRequestError(status, message)
            raise _Retryable(f"HTTP {status}: {message}", status=status)
        except TimeoutError as exc:
            outcome = "timeout"
            raise _Retryable("timed out", "timeout") from exc
        except (OSError, ValueError) as exc:  # inference.http.HttpConnectionError is an OSError
            raise _Retryable(f"{type(exc).__name__}: {exc}") from exc
        finally:
            server.outstanding -= 1
            server.latency.observe(time.monotonic() - started)
            server.requests[outcome].inc()

    async def wait_healthy(self, limit_s: float, poll_s: float = 0.2) -> bool:
        """Poll `/health` until a server answers 200 (True) or `limit_s` passes (False)."""
        if self._http is None or self._closed:
            raise InferenceError("client is not started (or already closed)")
        deadline = time.monotonic() + limit_s
        while True:
            await asyncio.gather(*(self._check(s) for s in self._servers.values()))
            if any(s.healthy for s in self._servers.values()):
                return True
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(min(poll_s, max(0.0, deadline - time.monotonic())))

    async def _health_loop(self) -> None:
        while True:
            await asyncio.gather(*(self._check(s) for s in self._servers.values()))
            await asyncio.sleep(self.config.health_interval_s)

    async def _check(self, server: _Server) -> None:
        assert self._http is not None
        try:
            resp = await self._http.request(
                "GET", server.url + "/health", None, self.config.health_timeout_s
            )
            server.healthy = resp.status == 200
        except (TimeoutError, OSError):
            server.healthy = False
        server.healthy_gauge.set(1 if server.healthy else 0)


def _partial_versions(stream: StreamedCompletion, adapter: ServedAdapter | None) -> list[int]:
    """Versions of a broken-off stream's tokens: -1 where its events did not label them
    (vLLM labels a streamed output only on its final chunk)."""
    count = len(stream.token_ids)
    if adapter is not None:
        return [adapter.version] * count
    try:
        return expand_versions(stream.spans, count)
    except _Retryable:
        return [-1] * count


def _check_choice(data: Any) -> dict[str, Any]:
    """The first choice of a completion response, or _Retryable if it is not what we asked for."""
    try:
        choice = data["choices"][0]
        if "weight_versions" not in choice:
            raise InferenceError(
                "server does not return weight_versions (needs return_weight_versions support)"
            )
        ids, lps = choice["token_ids"], choice["logprobs"]["token_logprobs"]
        if (
            not isinstance(ids, list)
            or len(ids) != len(lps)
            or not isinstance(choice["weight_versions"], list)
        ):
            raise _Retryable("response token_ids/logprobs/weight_versions are inconsistent")
        return choice
    except (KeyError, IndexError, TypeError) as exc:
        raise _Retryable(f"malformed completion response: {exc!r}") from exc
