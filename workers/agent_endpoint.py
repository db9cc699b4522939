"""The worker's token-capturing OpenAI-compatible endpoint, one per worker process.

It serves `POST /v1/chat/completions` (tools, multi-turn, streaming), `POST /v1/responses`
(the Responses API, answered through the same chat path: `inference.openai.responses_route`;
stored responses live with the episode and expire with its key) and `GET /v1/models` on
localhost for every agent episode of the process; each episode has its own key
(`Authorization: Bearer <key>`), and a request with an unknown or expired key is answered 401
before anything is rendered or recorded. A call is rendered with the model's chat template by
the workers' `ChatCodec`, generated token in / token out through the `GenerationClient`
(sticky per episode, failover, weight versions), recorded exactly in the episode's
`EpisodeRecord`, and answered in OpenAI's shape: the reasoning split off by the run's reasoning
parser (`reasoning`, as vLLM 0.33 names the field) and tool calls parsed by the run's tool
parser (`workers.answers`). With `--reasoning-history keep`, a call that repeats the previous
call and the reply it got is rendered as a continuation of that call's tokens
(`workers.agent_record`), so the endpoint records the same tokens as a worker's own episode of
the same conversation; other calls are rendered whole by the template, with the run's template
kwargs under the request's `chat_template_kwargs`. A forced `tool_choice` (`required`, a named
function) puts the model's call opener at the end of the prompt (`inference.openai.tool_choice`),
so what is recorded as completion is only what was sampled.

Streaming: the generation client returns a whole completion, so a streamed answer is sent as
OpenAI's chunk sequence (role, content, closing delta with the tool calls, usage, `[DONE]`)
once the completion is generated.
"""

from __future__ import annotations

import contextlib
import json
import secrets
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import orjson
from aiohttp import web

from broker.messages import mix_seed
from inference.client import Generation, Generator, SamplingParams
from inference.errors import InferenceError
from inference.openai.errors import ApiError, from_validation
from inference.openai.models import ChatCompletionRequest
from inference.openai.render import render_chat_request, template_arguments, template_messages
from inference.openai.responses import (
    Generated,
    OutputFormat,
    StreamHead,
    chat_choice,
    chat_chunk,
    chat_finish_reason,
    chat_stream_choice,
    usage,
    usage_chunk,
)
from inference.openai.responses_api import ResponseStore
from inference.openai.responses_route import serve_responses
from inference.openai.schema import ChatCompletionResponse, ChatDelta, DeltaToolCall
from inference.openai.sse import SSE_DONE, open_event_stream, sse_event
from inference.openai.stream import ChatChoiceStream
from inference.openai.text import ChoiceText
from inference.openai.tool_choice import check_template, forced_call_text, is_forced
from inference.openai.tools import ParsedMessage, extract_tool_calls, openai_calls
from workers.agent_record import Continuation, EpisodeRecord, reply_key
from workers.answers import Answer, AnswerReader
from workers.tokens import ChatCodec
from workers.transcript import History

T = TypeVar("T", int, float)


@dataclass(frozen=True)
class SamplingDefaults:
    """Sampling an episode's calls get where the request leaves a field unset."""

    temperature: float  # the worker's --temperature
    top_p: float  # the worker's --top-p
    max_tokens: int  # the worker's --max-tokens, for a request that sets none
    top_k: int = 0  # the worker's --top-k
    min_p: float = 0.0  # the worker's --min-p
    # the episode's seed base: every call is seeded from it, the call's number and any seed
    # the agent passes, so a group's episodes never share draws (None: unseeded)
    seed_base: int | None = None


RENDER_CACHE = 8  # renders an episode keeps: a retried or repeated call is not rendered again


@dataclass(frozen=True)
class _Episode:
    record: EpisodeRecord
    session_id: str  # sticky inference session of the episode
    defaults: SamplingDefaults
    # what the template made of a call's conversation: its render key -> its prompt ids
    renders: dict[bytes, tuple[int, ...]] = field(default_factory=dict)
    responses: ResponseStore = field(default_factory=ResponseStore)  # for previous_response_id


class AgentEndpoint:
    """The endpoint: `await start()`, then `open_episode` / `close_episode` per episode."""

    def __init__(
        self,
        codec: ChatCodec,
        client: Generator,
        model_name: str = "policy",
        *,
        reader: AnswerReader | None = None,
        history: History = "keep",
    ) -> None:
        self.codec = codec
        self.client = client
        self.model_name = model_name
        self.reader = reader if reader is not None else AnswerReader(codec)
        self.history = history
        self._episodes: dict[str, _Episode] = {}
        self._runner: web.AppRunner | None = None
        self.base_url = ""

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        """Listen on `host:port` (0: any free port); returns the `/v1` base URL."""
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_post("/v1/responses", self._responses)
        app.router.add_get("/v1/models", self._models)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port)
        await site.start()
        self.base_url = f"http://{host}:{self._runner.addresses[0][1]}/v1"
        return self.base_url

    @contextlib.asynccontextmanager
    async def serve_unix(self, path: Path) -> AsyncIterator[None]:
        """Serve the endpoint on a Unix socket at `path` too, while in the block: a sandbox
        session's bridge (`sandbox.Bridge`), through which a program in the sandbox calls it
        with no network. Keys work as on the TCP port."""
        if self._runner is None:
            raise RuntimeError("start() the endpoint before bridging it")
        site = web.UnixSite(self._runner, str(path))
        await site.start()
        try:
            yield
        finally:
            await site.stop()

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    def open_episode(
        self, record: EpisodeRecord, session_id: str, defaults: SamplingDefaults
    ) -> str:
        """A new key that routes calls to `record`."""
        key = f"ep-{secrets.token_urlsafe(24)}"
        self._episodes[key] = _Episode(record, session_id, defaults)
        return key

    def close_episode(self, key: str) -> None:
        """Expire the key; calls in flight are not recorded any more."""
        episode = self._episodes.pop(key, None)
        if episode is not None:
            episode.record.closed = True
            self.client.end_session(episode.session_id)

    # --- routes ---------------------------------------------------------------------------------
    def _lookup(self, request: web.Request) -> _Episode:
        auth = request.headers.get("Authorization", "")
        key = auth.removeprefix("Bearer ").strip()
        episode = self._episodes.get(key)
        if episode is None:
            raise ApiError("unknown or expired episode key", status=401)
        return episode

    async def _models(self, request: web.Request) -> web.Response:
        try:
            self._lookup(request)
        except ApiError as exc:
            return web.json_response(exc.body(), status=exc.status)
        model = {"id": self.model_name, "object": "model", "created": 0, "owned_by": "farm"}
        return web.json_response({"object": "list", "data": [model]})

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        try:
            episode = self._lookup(request)
            req = _parse(await request.read())
            return await self._complete(request, episode, req)
        except ApiError as exc:
            return web.json_response(exc.body(), status=exc.status)

    async def _responses(self, request: web.Request) -> web.StreamResponse:
        try:
            episode = self._lookup(request)

            async def complete(body: dict[str, Any]) -> dict[str, Any]:
                answer = await self._complete(request, episode, _validate(body))
                return json.loads(answer.text or "{}")  # type: ignore[attr-defined]

            return await serve_responses(request, episode.responses, complete)
        except ApiError as exc:
            return web.json_response(exc.body(), status=exc.status)

    async def _complete(
        self, request: web.Request, episode: _Episode, req: ChatCompletionRequest
    ) -> web.StreamResponse:
        record = episode.record
        prompt, messages, tools = self._prompt(episode, req)
        forced = forced_call_text(req)  # a forced tool choice: prompt, never completion
        if forced:
            check_template(forced, self.codec.chat_template)
            prompt = [*prompt, *self.codec.encode_control(forced)]
        max_tokens = record.admit(len(prompt), req.output_limit() or episode.defaults.max_tokens)
        defaults = episode.defaults
        seed = req.seed
        if defaults.seed_base is not None:
            seed = mix_seed(defaults.seed_base, record.calls, req.seed or 0)
        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=_pick(req.temperature, defaults.temperature),
            top_p=_pick(req.top_p, defaults.top_p),
            top_k=max(_pick(req.top_k, defaults.top_k), 0),  # -1 and 0 both mean off
            min_p=_pick(req.min_p, defaults.min_p),
            seed=seed,
            stop_token_ids=(*self.codec.stop_token_ids, *(req.stop_token_ids or ())),
        )
        t0 = time.monotonic()
        try:
            gen = await self.client.generate(prompt, params, session_id=episode.session_id)
        except InferenceError as exc:
            record.failure = exc
            raise ApiError(f"inference failed: {exc}", status=503) from None
        finally:
            record.inference_s += time.monotonic() - t0
        kwargs = {**self.codec.template_kwargs, **(req.chat_template_kwargs or {})}
        answer = self.reader.read(
            gen.token_ids, thinking=kwargs.get("enable_thinking", True) is not False
        )
        record.record(prompt, gen, params.distribution(), answer.reasoning_tokens)
        text = ChoiceText(self._decoder(req.skip_special_tokens), req.stop_strings())
        text.feed(gen.token_ids, final=True)
        reason = "stop" if text.stopped else gen.finish_reason
        fmt = OutputFormat(
            token_text=lambda t: self.codec.decode([t], skip_special=False),
            logprobs=bool(req.logprobs),
            top_logprobs=0,
            token_ids=bool(req.return_token_ids),
            weight_versions=bool(req.return_weight_versions),
        )
        generated = _generated(gen)
        parsed = (
            extract_tool_calls(forced + text.text) if forced else self._parsed(req, text, answer)
        )
        record.last = Continuation(tuple(messages), _reply(parsed), tools, tuple(gen.token_ids))
        if req.stream:
            return await self._stream(
                request,
                req,
                text,
                generated,
                fmt,
                reason=reason,
                prompt_len=len(prompt),
                parsed=parsed,
            )
        body = ChatCompletionResponse(
            model=req.model or self.model_name,
            choices=[
                chat_choice(0, parsed, generated, fmt, finish_reason=reason, stop_reason=None)
            ],
            usage=usage(len(prompt), len(gen.token_ids)),
            prompt_token_ids=prompt if req.return_token_ids else None,
        )
        return web.json_response(text=body.model_dump_json())

    def _prompt(
        self, episode: _Episode, req: ChatCompletionRequest
    ) -> tuple[list[int], list[dict[str, Any]], Any]:
        """The call's prompt ids, and its messages and tools as the template gets them."""
        record = episode.record
        messages = template_messages(req.messages)
        tools = req.template_tools()
        kwargs = {**self.codec.template_kwargs, **(req.chat_template_kwargs or {})}
        last = record.last
        if (
            self.history == "keep"
            and last is not None
            and req.add_generation_prompt
            and kwargs == self.codec.template_kwargs
            and record.context[-len(last.completion) :] == list(last.completion)
        ):
            new = last.new_messages(messages, tools)
            if new and all(m.get("role") != "assistant" for m in new):
                return (
                    [*record.context, *self.codec.next_prompt(last.completion, new)],
                    messages,
                    tools,
                )
        return self._render(episode, req, messages, tools), messages, tools

    def _render(
        self, episode: _Episode, req: ChatCompletionRequest, messages: list[Any], tools: Any
    ) -> list[int]:
        """The template's prompt ids for the call, from the episode's cache when it rendered
        the same conversation (messages, tools, template kwargs) before."""
        key = orjson.dumps(
            [messages, tools, req.add_generation_prompt, req.chat_template_kwargs],
            option=orjson.OPT_SORT_KEYS,
            default=str,
        )
        ids = episode.renders.get(key)
        if ids is None:
            ids = tuple(render_chat_request(self.codec, req))
            if len(episode.renders) >= RENDER_CACHE:
                episode.renders.pop(next(iter(episode.renders)))  # the oldest
            episode.renders[key] = ids
        return list(ids)

    def _parsed(
        self, req: ChatCompletionRequest, text: ChoiceText, answer: Answer
    ) -> ParsedMessage:
        """The reply: reasoning, content and tool calls, read with the run's parsers."""
        if self.reader.plain:
            if req.parses_tools():
                return extract_tool_calls(text.text)
            return ParsedMessage(text.text, [])
        action = answer.action
        reasoning = action.reasoning or None
        found = action.parsed if action.parsed is not None else None
        if req.parses_tools():
            if found is None:
                plain = extract_tool_calls(str(action))
                return ParsedMessage(plain.content, plain.tool_calls, reasoning)
            if found.calls and found.error is None:
                return ParsedMessage(found.content or None, openai_calls(found.calls), reasoning)
        return ParsedMessage(str(action), [], reasoning)

    def _decoder(self, skip_special: bool) -> Any:
        return lambda ids: self.codec.decode(ids, skip_special=skip_special)

    async def _stream(
        self,
        request: web.Request,
        req: ChatCompletionRequest,
        text: ChoiceText,
        gen: Generated,
        fmt: OutputFormat,
        *,
        reason: str,
        prompt_len: int,
        parsed: ParsedMessage,
    ) -> web.StreamResponse:
        """The generated choice as OpenAI's chunk sequence."""
        if not self.reader.plain or is_forced(req):  # read whole: one delta carries it
            return await self._stream_whole(
                request, req, gen, fmt, reason=reason, prompt_len=prompt_len, parsed=parsed
            )
        head = StreamHead(req.model or self.model_name)
        stream = ChatChoiceStream(text, req.parses_tools())
        response = await open_event_stream(request)
        opening = chat_stream_choice(0, ChatDelta(role="assistant", content=""))
        await response.write(sse_event(chat_chunk(head, [opening])))
        content = stream.content_delta()
        if content:
            await response.write(
                sse_event(chat_chunk(head, [chat_stream_choice(0, ChatDelta(content=content))]))
            )
        delta, calls = stream.final_delta()
        closing = chat_stream_choice(
            0, delta, gen, fmt, finish_reason=chat_finish_reason(reason, calls), stop_reason=None
        )
        await response.write(sse_event(chat_chunk(head, [closing])))
        if req.include_usage():
            counts = usage(prompt_len, len(gen.token_ids))
            await response.write(sse_event(usage_chunk(head, counts)))
        await response.write(SSE_DONE)
        await response.write_eof()
        return response

    async def _stream_whole(
        self,
        request: web.Request,
        req: ChatCompletionRequest,
        gen: Generated,
        fmt: OutputFormat,
        *,
        reason: str,
        prompt_len: int,
        parsed: ParsedMessage,
    ) -> web.StreamResponse:
        head = StreamHead(req.model or self.model_name)
        response = await open_event_stream(request)
        opening = chat_stream_choice(0, ChatDelta(role="assistant", content=""))
        await response.write(sse_event(chat_chunk(head, [opening])))
        calls = [DeltaToolCall(index=k, **c.model_dump()) for k, c in enumerate(parsed.tool_calls)]
        delta = ChatDelta(
            content=parsed.content, reasoning=parsed.reasoning, tool_calls=calls or None
        )
        closing = chat_stream_choice(
            0,
            delta,
            gen,
            fmt,
            finish_reason=chat_finish_reason(reason, bool(calls)),
            stop_reason=None,
        )
        await response.write(sse_event(chat_chunk(head, [closing])))
        if req.include_usage():
            await response.write(
                sse_event(usage_chunk(head, usage(prompt_len, len(gen.token_ids))))
            )
        await response.write(SSE_DONE)
        await response.write_eof()
        return response


def _reply(parsed: ParsedMessage) -> dict[str, Any]:
    """The reply as `reply_key` reads it back from the next call's history."""
    calls = [
        {
            "function": {
                "name": c.function.name,
                "arguments": template_arguments(c.function.arguments),
            }
        }
        for c in parsed.tool_calls
    ]
    return reply_key({"role": "assistant", "content": parsed.content, "tool_calls": calls})


def _parse(raw: bytes) -> ChatCompletionRequest:
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ApiError(f"malformed JSON body: {exc}") from None
    return _validate(body)


def _validate(body: Any) -> ChatCompletionRequest:
    from pydantic import ValidationError

    if not isinstance(body, dict):
        raise ApiError("request body must be a JSON object")
    if body.get("n", 1) != 1:
        raise ApiError("n must be 1: one call is one turn of the episode", "n")
    try:
        req = ChatCompletionRequest.model_validate(body)
    except ValidationError as exc:
        raise from_validation(exc) from None
    return req


def _pick(value: T | None, default: T) -> T:
    return default if value is None else value


def _generated(gen: Generation) -> Generated:
    labels = [str(v) for v in gen.weight_versions]
    return Generated(gen.token_ids, gen.logprobs, [()] * len(gen.token_ids), labels)
