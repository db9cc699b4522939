"""The worker's token-capturing OpenAI-compatible endpoint, one per worker process.

It serves `POST /v1/chat/completions` (tools, multi-turn, streaming), `POST /v1/responses`
(the Responses API, answered through the same chat path: `inference.openai.responses_route`;
stored responses live with the episode and expire with its key) and `GET /v1/models` on
localhost for every agent episode of the process; each episode has its own key
(`Authorization: Bearer <key>`), and a request with an unknown or expired key is answered 401
before anything is rendered or recorded. A call's messages are validated and turned into
template dicts once per episode, the ones its previous call sent reused (`workers.agent_history`);
it is rendered with the model's chat template by the workers' `ChatCodec`, generated token in / token out through the `GenerationClient`
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

Transports: `answer(method, path, authorization, body)` builds the answer as a transport-free
`Reply` (`inference.openai.reply`); the aiohttp routes (TCP, and a sandbox session's Unix
socket) send it, and `workers.agent_transport` hands it to an agent in this process with no
HTTP at all. Streaming: a plain-text reply is sent as OpenAI's chunk sequence while it is
generated (`workers.agent_stream.live_chat_frames`; the generation client streams the tokens
from the policy server), its tool calls and logprobs on the closing chunk; a reply read whole (the
run's reasoning or tool parser, a forced tool choice) is sent as chunks once it is generated. A
streamed `/v1/responses` call takes the same deltas (`live_deltas`) as text events. A refused
call (limits, a bad request) is an HTTP error before any chunk; an inference failure after the
first chunk is an error event.
"""

from __future__ import annotations

import contextlib
import secrets
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import orjson
from aiohttp import web

from broker.messages import mix_seed
from inference.client import Generation, SamplingParams, StreamingGenerator
from inference.completion_stream import TokenSink
from inference.errors import InferenceError
from inference.openai.body import json_body
from inference.openai.errors import ApiError
from inference.openai.models import ChatCompletionRequest
from inference.openai.render import template_arguments
from inference.openai.reply import Reply, send
from inference.openai.responses import Generated, OutputFormat, chat_completion_body
from inference.openai.responses_api import ResponseStore
from inference.openai.responses_route import answer_responses
from inference.openai.stream import ChatChoiceStream
from inference.openai.text import ChoiceText
from inference.openai.tool_choice import check_template, forced_call_text, is_forced
from inference.openai.tools import ParsedMessage, extract_tool_calls, openai_calls
from workers.agent_history import MessageCache
from workers.agent_record import Continuation, EpisodeRecord, reply_key
from workers.agent_stream import Call, chat_frames, live_chat_frames, live_deltas
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


Route = Callable[["_Episode", bytes], Awaitable[Reply]]  # an episode's request body -> answer
RENDER_CACHE = 8  # renders an episode keeps: a retried or repeated call is not rendered again


@dataclass(frozen=True)
class _Episode:
    record: EpisodeRecord
    session_id: str  # sticky inference session of the episode
    defaults: SamplingDefaults
    # what the template made of a call's conversation: its render key -> its prompt ids
    renders: dict[bytes, tuple[int, ...]] = field(default_factory=dict)
    responses: ResponseStore = field(default_factory=ResponseStore)  # for previous_response_id
    history: MessageCache = field(default_factory=MessageCache)  # the last call's messages


@dataclass(frozen=True)
class _Admitted:
    """A call the episode's limits let through, ready to generate."""

    episode: _Episode
    req: ChatCompletionRequest
    model: str  # the name its answer carries
    prompt: list[int]  # what the model is given, a forced call's opener included
    messages: list[dict[str, Any]]  # the conversation as the template got it
    tools: Any  # and its tools
    forced: str  # a forced tool choice's opener ("" if none)
    params: SamplingParams
    # read whole (the run's reasoning or tool parser, or a forced tool choice): a streamed
    # reply is sent once it is generated, not as it is
    whole: bool


class AgentEndpoint:
    """The endpoint: `await start()`, then `open_episode` / `close_episode` per episode."""

    def __init__(
        self,
        codec: ChatCodec,
        client: StreamingGenerator,
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
        self._routes: dict[tuple[str, str], Route] = {
            ("POST", "/v1/chat/completions"): self._chat,
            ("POST", "/v1/responses"): self._responses,
            ("GET", "/v1/models"): self._models,
        }

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        """Listen on `host:port` (0: any free port); returns the `/v1` base URL."""
        app = web.Application(client_max_size=64 * 1024 * 1024)
        for method, path in self._routes:
            app.router.add_route(method, path, self._serve)
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
    async def answer(self, method: str, path: str, authorization: str, raw: bytes) -> Reply:
        """Answer one request, whatever carried it: the HTTP server's routes and the
        in-process transport (`workers.agent_transport`) both end here. `authorization` is
        the request's `Authorization` header; `raw` its body."""
        route = self._routes.get((method, path))
        if route is None:
            return Reply.error(ApiError(f"no route {method} {path}", status=404))
        try:
            return await route(self._lookup(authorization), raw)
        except ApiError as exc:
            return Reply.error(exc)

    async def _serve(self, request: web.Request) -> web.StreamResponse:
        auth = request.headers.get("Authorization", "")
        return await send(
            request, await self.answer(request.method, request.path, auth, await request.read())
        )

    def _lookup(self, authorization: str) -> _Episode:
        episode = self._episodes.get(authorization.removeprefix("Bearer ").strip())
        if episode is None:
            raise ApiError("unknown or expired episode key", status=401)
        return episode

    async def _models(self, episode: _Episode, raw: bytes) -> Reply:
        model = {"id": self.model_name, "object": "model", "created": 0, "owned_by": "farm"}
        return Reply.json({"object": "list", "data": [model]})

    async def _chat(self, episode: _Episode, raw: bytes) -> Reply:
        req = episode.history.request(json_body(raw))
        call = self._admit(episode, req)  # a refusal is an HTTP error, streamed or not
        if req.stream and not call.whole:  # plain text: sent as it is generated
            return Reply.stream(live_chat_frames(req, call.model, *self._live(call)))
        done = await self._generate(call)
        if req.stream:
            return Reply.stream(chat_frames(req, done))
        return Reply.json(_completion(req, done))

    async def _responses(self, episode: _Episode, raw: bytes) -> Reply:
        async def complete(body: dict[str, Any]) -> dict[str, Any]:
            req = episode.history.request(body)
            return _completion(req, await self._generate(self._admit(episode, req)))

        def live(body: dict[str, Any]) -> tuple[str, AsyncGenerator[str | dict[str, Any], None]]:
            req = episode.history.request(body)
            call = self._admit(episode, req)  # a refusal is an HTTP error before the stream
            return call.model, self._pieces(call)

        return await answer_responses(raw, episode.responses, complete, live)

    async def _pieces(self, call: _Admitted) -> AsyncGenerator[str | dict[str, Any], None]:
        """A streamed `/v1/responses` call: its content deltas as it is generated (plain
        text), then its chat completion dict."""
        if call.whole:
            yield _completion(call.req, await self._generate(call))
            return
        _, pieces = self._live(call)
        async with contextlib.aclosing(pieces) as deltas:
            async for piece in deltas:
                yield piece if isinstance(piece, str) else _completion(call.req, piece)

    def _live(self, call: _Admitted) -> tuple[ChatChoiceStream, AsyncGenerator[str | Call, None]]:
        """A plain-text call's stream state, and its content deltas then the Call as it is
        generated (`live_deltas`)."""
        text = self._text(call.req)
        stream = ChatChoiceStream(text, call.req.parses_tools())
        return stream, live_deltas(stream, lambda sink: self._generate(call, text, sink))

    def _admit(self, episode: _Episode, req: ChatCompletionRequest) -> _Admitted:
        """The call's prompt and sampling, within the episode's limits (ApiError if not)."""
        prompt, messages, tools = self._prompt(episode, req)
        forced = forced_call_text(req)  # a forced tool choice: prompt, never completion
        if forced:
            check_template(forced, self.codec.chat_template)
            prompt = [*prompt, *self.codec.encode_control(forced)]
        limit = req.output_limit() or episode.defaults.max_tokens
        max_tokens = episode.record.admit(len(prompt), limit)
        params = self._params(episode, req, max_tokens)
        model = req.model or self.model_name
        whole = not self.reader.plain or is_forced(req)
        return _Admitted(episode, req, model, prompt, messages, tools, forced, params, whole)

    async def _generate(
        self, call: _Admitted, text: ChoiceText | None = None, sink: TokenSink | None = None
    ) -> Call:
        """Generate an admitted call and record it in the episode; `text` (the streamed
        reply's, fed as tokens come) and `sink` when it is sent as it is generated."""
        episode, req, prompt, forced = call.episode, call.req, call.prompt, call.forced
        record = episode.record
        t0 = time.monotonic()
        try:
            gen = await self.client.generate(
                prompt, call.params, session_id=episode.session_id, on_tokens=sink
            )
        except InferenceError as exc:
            record.failure = exc
            raise ApiError(f"inference failed: {exc}", status=503) from None
        finally:
            record.inference_s += time.monotonic() - t0
        answer = None if self.reader.plain else self._read(req, gen.token_ids)
        reasoning = answer.reasoning_tokens if answer is not None else 0
        record.record(prompt, gen, call.params.distribution(), reasoning)
        text = text if text is not None else self._text(req)
        text.feed(gen.token_ids, final=True)
        parsed = (
            extract_tool_calls(forced + text.text) if forced else self._parsed(req, text, answer)
        )
        record.last = Continuation(
            tuple(call.messages), _reply(parsed), call.tools, tuple(gen.token_ids)
        )
        fmt = OutputFormat(
            token_text=lambda t: self.codec.decode([t], skip_special=False),
            logprobs=bool(req.logprobs),
            top_logprobs=0,
            token_ids=bool(req.return_token_ids),
            weight_versions=bool(req.return_weight_versions),
        )
        return Call(
            model=call.model,
            prompt=prompt,
            generated=_generated(gen),
            text=text,
            reason="stop" if text.stopped else gen.finish_reason,
            parsed=parsed,
            fmt=fmt,
            whole=call.whole,
        )

    def _text(self, req: ChatCompletionRequest) -> ChoiceText:
        return ChoiceText(self._decoder(req.skip_special_tokens), req.stop_strings())

    def _params(
        self, episode: _Episode, req: ChatCompletionRequest, max_tokens: int
    ) -> SamplingParams:
        """The call's sampling: the request's, the episode's defaults where it sets none."""
        defaults = episode.defaults
        seed = req.seed
        if defaults.seed_base is not None:
            seed = mix_seed(defaults.seed_base, episode.record.calls, req.seed or 0)
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=_pick(req.temperature, defaults.temperature),
            top_p=_pick(req.top_p, defaults.top_p),
            top_k=max(_pick(req.top_k, defaults.top_k), 0),  # -1 and 0 both mean off
            min_p=_pick(req.min_p, defaults.min_p),
            seed=seed,
            stop_token_ids=(*self.codec.stop_token_ids, *(req.stop_token_ids or ())),
            allowed_token_ids=tuple(req.allowed_token_ids) if req.allowed_token_ids else None,
        )

    def _prompt(
        self, episode: _Episode, req: ChatCompletionRequest
    ) -> tuple[list[int], list[dict[str, Any]], Any]:
        """The call's prompt ids, and its messages and tools as the template gets them."""
        record = episode.record
        messages = episode.history.template(req.messages)
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
            ids = tuple(
                self.codec.render_messages(
                    messages,
                    tools,
                    add_generation_prompt=req.add_generation_prompt,
                    template_kwargs=req.chat_template_kwargs,
                )
            )
            if len(episode.renders) >= RENDER_CACHE:
                episode.renders.pop(next(iter(episode.renders)))  # the oldest
            episode.renders[key] = ids
        return list(ids)

    def _read(self, req: ChatCompletionRequest, token_ids: list[int]) -> Answer:
        """The completion read by the run's reasoning and tool parsers (not for a plain
        reader: its answer is the text, which the call decodes anyway)."""
        kwargs = {**self.codec.template_kwargs, **(req.chat_template_kwargs or {})}
        return self.reader.read(
            token_ids, thinking=kwargs.get("enable_thinking", True) is not False
        )

    def _parsed(
        self, req: ChatCompletionRequest, text: ChoiceText, answer: Answer | None
    ) -> ParsedMessage:
        """The reply: reasoning, content and tool calls, read with the run's parsers."""
        if answer is None:
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


def _completion(req: ChatCompletionRequest, call: Call) -> dict[str, Any]:
    return chat_completion_body(
        call.model,
        call.parsed,
        call.generated,
        call.fmt,
        finish_reason=call.reason,
        prompt_ids=call.prompt if req.return_token_ids else None,
        prompt_tokens=len(call.prompt),
    )


def _pick(value: T | None, default: T) -> T:
    return default if value is None else value


def _generated(gen: Generation) -> Generated:
    labels = [str(v) for v in gen.weight_versions]
    return Generated(gen.token_ids, gen.logprobs, [()] * len(gen.token_ids), labels)
