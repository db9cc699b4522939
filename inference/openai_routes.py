"""The CPU policy server's OpenAI routes: `/v1/chat/completions`, `/v1/responses`, `/tokenize`,
`/detokenize`.

A thin layer over `inference.openai` (request and response models, rendering, tool-call
parsing, SSE) and `inference.openai_generate` (engine parameters, watched requests).
`add_openai_routes(app, state_key)` registers them; text and streamed `/v1/completions` live
in `openai_completions.py`. Every refusal is a 4xx in vLLM's ErrorResponse shape.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from aiohttp import web

from inference.lora import LoraAdapter
from inference.openai.body import json_body, parse_body, validate
from inference.openai.errors import ApiError, model_not_found
from inference.openai.models import (
    ChatCompletionRequest,
    DetokenizeRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
)
from inference.openai.render import TokenizerRenderer, render_chat_request
from inference.openai.reply import send
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
from inference.openai.responses_route import answer_responses
from inference.openai.schema import (
    ChatCompletionResponse,
    ChatDelta,
    DetokenizeResponse,
    TokenizeResponse,
    Usage,
)
from inference.openai.sse import SSE_DONE, open_event_stream, sse_event
from inference.openai.stream import ChatChoiceStream
from inference.openai.tool_choice import check_template, forced_call_text
from inference.openai.tools import ParsedMessage, extract_tool_calls
from inference.openai_generate import WatchedRequest, abort_all, check_ids, gen_params, generate
from inference.sequence import GenRequest, Sequence

if TYPE_CHECKING:
    from inference.engine import Engine
    from inference.protocol import Limits


class ServerView(Protocol):
    """What the OpenAI routes read of the policy server's `ServerState` (server.py
    imports this module, so the routes name the shape rather than the class)."""

    engine: Engine
    tokenizer: Any  # a Hugging Face tokenizer, as TokenizerRenderer takes it
    model_name: str
    limits: Limits


S = TypeVar("S", bound=ServerView)
RENDERER = web.AppKey("openai_renderer", TokenizerRenderer)
SERVER = web.AppKey[ServerView]("openai_server_state")  # a protocol: no class to pass
RESPONSE_STORE = web.AppKey("openai_response_store", ResponseStore)
Handler = Callable[..., Awaitable[web.StreamResponse]]


def api_errors(handler: Handler) -> Handler:
    """Answer an ApiError with its status and vLLM's error body."""

    @functools.wraps(handler)
    async def wrapped(request: web.Request, *args: Any) -> web.StreamResponse:
        try:
            return await handler(request, *args)
        except ApiError as exc:
            return web.json_response(exc.body(), status=exc.status)

    return wrapped


def check_model(name: str | None, state: Any) -> LoraAdapter | None:
    """The LoRA adapter `name` asks for (None: the base model); 404 for a name not served."""
    if name is None or name == state.model_name:
        return None
    adapter = state.adapter(name)
    if adapter is None:
        raise model_not_found(name)
    return adapter


def served_name(gen: GenRequest, state: Any) -> str:
    """The `model` of a response: the adapter's name when one generated it (as vLLM)."""
    return gen.adapter.name if gen.adapter is not None else state.model_name


def token_namer(renderer: TokenizerRenderer, as_ids: bool | None) -> Callable[[int], str]:
    if as_ids:
        return lambda t: f"token_id:{t}"
    return lambda t: renderer.decode([t], skip_special_tokens=False)


def generated(seq: Sequence, start: int = 0) -> Generated:
    """The engine sequence's tokens from `start` on, in the shared builders' terms."""
    end = len(seq.tokens)
    return Generated(
        seq.tokens[start:end],
        seq.logprobs[start:end],
        seq.tops[start:end],
        seq.versions[start:end],
        start,
    )


def _chat_format(req: ChatCompletionRequest, renderer: TokenizerRenderer) -> OutputFormat:
    return OutputFormat(
        token_text=token_namer(renderer, req.return_tokens_as_token_ids),
        logprobs=bool(req.logprobs),
        top_logprobs=(req.top_logprobs or 0) if req.logprobs else 0,
        token_ids=bool(req.return_token_ids),
        weight_versions=bool(req.return_weight_versions),
    )


def chat_response(
    req: ChatCompletionRequest,
    gen: WatchedRequest,
    model: str,
    fmt: OutputFormat,
    forced: str = "",
) -> ChatCompletionResponse:
    """The whole response; `forced` (a forced tool choice's opener) is read before each
    choice's text."""
    choices = []
    for index, (seq, text) in enumerate(zip(gen.seqs, gen.texts, strict=True)):
        whole = forced + text.text
        parsed = extract_tool_calls(whole) if req.parses_tools() else ParsedMessage(whole, [])
        choices.append(
            chat_choice(
                index,
                parsed,
                generated(seq),
                fmt,
                finish_reason=seq.finish_reason,
                stop_reason=seq.stop_reason,
            )
        )
    prompt = gen.seqs[0].prompt
    return ChatCompletionResponse(
        model=model,
        choices=choices,
        usage=usage(len(prompt), sum(len(s.tokens) for s in gen.seqs)),
        prompt_token_ids=list(prompt) if req.return_token_ids else None,
    )


def _chat_request(
    app: web.Application, req: ChatCompletionRequest
) -> tuple[WatchedRequest, OutputFormat, str]:
    """The engine request of a chat completion, what its answer shows of the tokens, and the
    text a forced tool choice put at the end of the prompt (inference.openai.tool_choice)."""
    state, renderer = app[SERVER], app[RENDERER]
    adapter = check_model(req.model, state)
    forced = forced_call_text(req)
    check_template(forced, getattr(state.tokenizer, "chat_template", None))
    prompt = render_chat_request(renderer, req)
    if forced:
        prompt += renderer.encode(forced, add_special_tokens=False)
    fmt = _chat_format(req, renderer)
    params = gen_params(req, len(prompt), state.limits, req.output_limit(), fmt.top_logprobs)
    stops, skip = req.stop_strings(), req.skip_special_tokens
    gen = WatchedRequest(
        prompt,
        params,
        renderer,
        stop=stops,
        skip_special_tokens=skip,
        progress=asyncio.Event(),
        adapter=adapter,
    )
    return gen, fmt, forced


@api_errors
async def chat_completions(request: web.Request) -> web.StreamResponse:
    state = request.app[SERVER]
    req = parse_body(await request.read(), ChatCompletionRequest)
    gen, fmt, forced = _chat_request(request.app, req)
    if req.stream:
        return await stream_chat(request, state, req, gen, fmt, forced=forced)
    await generate(state.engine, [gen])
    body = chat_response(req, gen, served_name(gen, state), fmt, forced)
    return web.json_response(text=body.model_dump_json())


@api_errors
async def responses(request: web.Request) -> web.StreamResponse:
    """`POST /v1/responses`, answered through the chat path (inference.openai.responses_route)."""
    state = request.app[SERVER]

    async def complete(body: dict[str, Any]) -> dict[str, Any]:
        req: ChatCompletionRequest = validate(ChatCompletionRequest, body)
        gen, fmt, forced = _chat_request(request.app, req)
        await generate(state.engine, [gen])
        answer = chat_response(req, gen, served_name(gen, state), fmt, forced)
        return answer.model_dump(mode="json")

    reply = await answer_responses(await request.read(), request.app[RESPONSE_STORE], complete)
    return await send(request, reply)


async def stream_chat(
    request: web.Request,
    state: ServerView,
    req: ChatCompletionRequest,
    gen: WatchedRequest,
    fmt: OutputFormat,
    *,
    forced: str = "",
) -> web.StreamResponse:
    """Send the choices as chat.completion.chunk events while the engine generates them."""
    head = StreamHead(served_name(gen, state))
    streams = [ChatChoiceStream(text, req.parses_tools(), forced) for text in gen.texts]
    state.engine.submit(gen)  # a refusal here is still a plain HTTP error, not a broken stream
    try:
        response = await open_event_stream(request)
        for index in range(len(streams)):
            opening = chat_stream_choice(index, ChatDelta(role="assistant", content=""))
            await response.write(sse_event(chat_chunk(head, [opening])))
        while not gen.done.done():
            await gen.progress.wait()
            gen.progress.clear()
            for index, (seq, stream) in enumerate(zip(gen.seqs, streams, strict=True)):
                choice = _next_choice(index, seq, stream, fmt)
                if choice is not None:
                    so_far = count_usage([gen]) if req.continuous_usage() else None
                    await response.write(sse_event(chat_chunk(head, [choice], so_far)))
        await close_stream(response, req, [gen], head)
    except (asyncio.CancelledError, ConnectionResetError):
        abort_all(state.engine, [gen])  # the client went away: free the batch slots
        raise
    return response


def _next_choice(index: int, seq: Sequence, stream: ChatChoiceStream, fmt: OutputFormat) -> Any:
    """This choice's part of a chunk for what happened since the last one, or None."""
    if stream.finished:
        return None
    start, stream.sent_tokens = stream.sent_tokens, len(seq.tokens)
    new = generated(seq, start)
    if seq.finish_reason is not None:
        stream.finished = True
        delta, calls = stream.final_delta()
        reason = chat_finish_reason(seq.finish_reason, calls)
        return chat_stream_choice(
            index, delta, new, fmt, finish_reason=reason, stop_reason=seq.stop_reason
        )
    content = stream.content_delta()
    reports_tokens = fmt.logprobs or fmt.token_ids or fmt.weight_versions
    if not content and not (new.token_ids and reports_tokens):
        return None
    return chat_stream_choice(
        index, ChatDelta(content=content) if content else ChatDelta(), new, fmt
    )


def count_usage(gens: list[WatchedRequest]) -> Usage:
    """Prompt tokens of every prompt and the tokens generated so far over all choices."""
    prompt = sum(len(g.seqs[0].prompt) for g in gens)
    return usage(prompt, sum(len(s.tokens) for g in gens for s in g.seqs))


async def close_stream(
    response: web.StreamResponse, req: Any, gens: list[WatchedRequest], head: StreamHead
) -> None:
    """The error that ended generation, or usage when asked for; then [DONE]."""
    errors = [g.done.exception() for g in gens if g.done.exception() is not None]
    if errors:
        status = getattr(errors[0], "status", 500)
        await response.write(
            sse_event(ApiError(f"generation failed: {errors[0]}", status=status).body())
        )
    elif req.include_usage():
        await response.write(sse_event(usage_chunk(head, count_usage(gens))))
    await response.write(SSE_DONE)
    await response.write_eof()


@api_errors
async def tokenize(request: web.Request) -> web.Response:
    state = request.app[SERVER]
    renderer = request.app[RENDERER]
    body = json_body(await request.read())
    chat = isinstance(body, dict) and "messages" in body
    req = validate(TokenizeChatRequest if chat else TokenizeCompletionRequest, body)
    check_model(req.model, state)
    if chat:
        if req.continue_final_message:
            raise ApiError("continue_final_message is not supported", "continue_final_message")
        ids = render_chat_request(renderer, req)
    else:
        ids = renderer.encode(req.prompt, add_special_tokens=req.add_special_tokens)
    strs = renderer.token_strings(ids) if req.return_token_strs else None
    answer = TokenizeResponse(
        count=len(ids), max_model_len=state.limits.max_model_len, tokens=ids, token_strs=strs
    )
    return web.json_response(text=answer.model_dump_json())


@api_errors
async def detokenize(request: web.Request) -> web.Response:
    state = request.app[SERVER]
    req = parse_body(await request.read(), DetokenizeRequest)
    check_model(req.model, state)
    check_ids(req.tokens, state.limits, "tokens")
    answer = DetokenizeResponse(prompt=request.app[RENDERER].decode(req.tokens))
    return web.json_response(text=answer.model_dump_json())


def add_openai_routes(app: web.Application, state_key: web.AppKey[S]) -> None:
    """Register the OpenAI routes on the policy server's app (its state under `state_key`)."""
    state: ServerView = app[state_key]
    app[SERVER] = state
    app[RENDERER] = TokenizerRenderer(state.tokenizer)
    app[RESPONSE_STORE] = ResponseStore()
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/responses", responses)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/detokenize", detokenize)
