"""The CPU policy server's OpenAI routes: `/v1/chat/completions`, `/tokenize`, `/detokenize`.

A thin layer over `inference.openai` (request models, rendering, tool-call parsing, response
and SSE shapes) and `inference.openai_generate` (engine parameters, watched requests).
`add_openai_routes(app, state_key)` registers them; text and streamed `/v1/completions` live
in `openai_completions.py`. Every refusal is a 4xx in vLLM's ErrorResponse shape.
"""

from __future__ import annotations

import asyncio
import functools
import json
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web
from pydantic import BaseModel, ValidationError

from inference.engine import Sequence
from inference.openai.errors import ApiError, from_validation, model_not_found
from inference.openai.models import (
    ChatCompletionRequest,
    DetokenizeRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
)
from inference.openai.render import TokenizerRenderer, template_messages
from inference.openai.responses import (
    chat_finish_reason,
    chat_logprobs,
    chat_message,
    envelope,
    usage,
    version_spans,
)
from inference.openai.sse import SSE_DONE, open_event_stream, sse_event
from inference.openai.stream import ChatChoiceStream
from inference.openai.tools import extract_tool_calls
from inference.openai_generate import (
    WatchedRequest,
    abort_all,
    check_ids,
    gen_params,
    generate,
)

RENDERER = web.AppKey("openai_renderer", TokenizerRenderer)
SERVER = web.AppKey("openai_server_state", Any)  # the policy server's ServerState
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


async def read_model(request: web.Request, model: type[BaseModel]) -> Any:
    """The body validated as `model`; malformed JSON or a bad field is a 400."""
    raw = await request.read()
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ApiError(f"malformed JSON body: {exc}") from None
    return validate(model, body)


def validate(model: type[BaseModel], body: Any) -> Any:
    if not isinstance(body, dict):
        raise ApiError("request body must be a JSON object")
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise from_validation(exc) from None


def check_model(name: str | None, served: str) -> None:
    if name is not None and name != served:
        raise model_not_found(name)


def token_namer(renderer: TokenizerRenderer, as_ids: bool | None) -> Callable[[int], str]:
    if as_ids:
        return lambda t: f"token_id:{t}"
    return lambda t: renderer.decode([t], skip_special_tokens=False)


def render_chat(renderer: TokenizerRenderer, req: ChatCompletionRequest) -> list[int]:
    return renderer.render_messages(
        template_messages(req.messages),
        req.template_tools(),
        add_generation_prompt=req.add_generation_prompt,
        template_kwargs=req.chat_template_kwargs,
    )


def _extras(req: ChatCompletionRequest, seq: Sequence, start: int) -> dict[str, Any]:
    """The project's per-choice fields for the tokens from `start` on."""
    extra: dict[str, Any] = {}
    if req.return_token_ids:
        extra["token_ids"] = list(seq.tokens[start:])
    if req.return_weight_versions:
        extra["weight_versions"] = version_spans(seq.versions[start:], start)
    return extra


def _logprobs(req: ChatCompletionRequest, seq: Sequence, start: int, name: Any) -> Any:
    if not req.logprobs:
        return None
    end = len(seq.tokens)
    tops = seq.tops[start:end]
    return chat_logprobs(
        seq.tokens[start:end], seq.logprobs[start:end], tops, name, req.top_logprobs or 0
    )


def chat_body(
    req: ChatCompletionRequest, gen: WatchedRequest, model: str, name: Any
) -> dict[str, Any]:
    choices = []
    for index, (seq, text) in enumerate(zip(gen.seqs, gen.texts, strict=True)):
        parsed = extract_tool_calls(text.text) if req.parses_tools() else None
        message = chat_message(parsed) if parsed else chat_message_text(text.text)
        choices.append(
            {
                "index": index,
                "message": message,
                "logprobs": _logprobs(req, seq, 0, name),
                "finish_reason": chat_finish_reason(seq.finish_reason, bool(message["tool_calls"])),
                "stop_reason": seq.stop_reason,
                **_extras(req, seq, 0),
            }
        )
    prompt = gen.seqs[0].prompt
    body = envelope("chat.completion", model) | {
        "choices": choices,
        "usage": usage(len(prompt), sum(len(s.tokens) for s in gen.seqs)),
    }
    if req.return_token_ids:
        body["prompt_token_ids"] = list(prompt)
    return body


def chat_message_text(text: str) -> dict[str, Any]:
    return {"role": "assistant", "content": text, "tool_calls": []}


@api_errors
async def chat_completions(request: web.Request) -> web.StreamResponse:
    state = request.app[SERVER]
    renderer = request.app[RENDERER]
    req: ChatCompletionRequest = await read_model(request, ChatCompletionRequest)
    check_model(req.model, state.model_name)
    prompt = render_chat(renderer, req)
    top = (req.top_logprobs or 0) if req.logprobs else 0
    params = gen_params(req, len(prompt), state.limits, req.output_limit(), top)
    progress = asyncio.Event()
    gen = WatchedRequest(
        prompt, params, renderer, req.stop_strings(), req.skip_special_tokens, progress
    )
    name = token_namer(renderer, req.return_tokens_as_token_ids)
    if req.stream:
        return await stream_chat(request, state, req, gen, name)
    await generate(state.engine, [gen])
    return web.json_response(chat_body(req, gen, state.model_name, name))


async def stream_chat(
    request: web.Request, state: Any, req: ChatCompletionRequest, gen: WatchedRequest, name: Any
) -> web.StreamResponse:
    """Send the choices as chat.completion.chunk events while the engine generates them."""
    head = envelope("chat.completion.chunk", state.model_name)
    streams = [ChatChoiceStream(text, req.parses_tools()) for text in gen.texts]
    response = await open_event_stream(request)
    try:
        state.engine.submit(gen)
        for index in range(len(streams)):
            delta = {"role": "assistant", "content": ""}
            await response.write(sse_event(head | {"choices": [_chunk(index, delta)]}))
        while not gen.done.done():
            await gen.progress.wait()
            gen.progress.clear()
            for index, (seq, stream) in enumerate(zip(gen.seqs, streams, strict=True)):
                choice = _next_chunk(req, index, seq, stream, name)
                if choice is not None:
                    await response.write(sse_event(head | {"choices": [choice], "usage": None}))
        await close_stream(response, req, gen, head)
    except (asyncio.CancelledError, ConnectionResetError):
        abort_all(state.engine, [gen])  # the client went away: free the batch slots
        raise
    return response


def _chunk(index: int, delta: dict[str, Any], **fields: Any) -> dict[str, Any]:
    return {"index": index, "delta": delta, "logprobs": None, "finish_reason": None} | fields


def _next_chunk(
    req: ChatCompletionRequest, index: int, seq: Sequence, stream: ChatChoiceStream, name: Any
) -> dict[str, Any] | None:
    """This choice's chunk for what happened since the last one, or None when nothing did."""
    if stream.finished:
        return None
    start = stream.sent_tokens
    stream.sent_tokens = len(seq.tokens)
    fields = {"logprobs": _logprobs(req, seq, start, name), **_extras(req, seq, start)}
    if seq.finish_reason is not None:
        stream.finished = True
        delta, calls = stream.final_delta()
        reason = chat_finish_reason(seq.finish_reason, calls)
        return _chunk(index, delta, finish_reason=reason, stop_reason=seq.stop_reason, **fields)
    content = stream.content_delta()
    if not content and (start == len(seq.tokens) or fields == {"logprobs": None}):
        return None
    return _chunk(index, {"content": content} if content else {}, **fields)


async def close_stream(
    response: web.StreamResponse, req: Any, gens: Any, head: dict[str, Any]
) -> None:
    """Usage (when asked for) or the error that ended generation, then [DONE]."""
    gens = gens if isinstance(gens, list) else [gens]
    errors = [g.done.exception() for g in gens if g.done.exception() is not None]
    if errors:
        status = getattr(errors[0], "status", 500)
        error = ApiError(f"generation failed: {errors[0]}", status=status)
        await response.write(sse_event(error.body()))
    elif req.include_usage():
        prompt = sum(len(g.seqs[0].prompt) for g in gens)
        completion = sum(len(s.tokens) for g in gens for s in g.seqs)
        await response.write(sse_event(head | {"choices": [], "usage": usage(prompt, completion)}))
    await response.write(SSE_DONE)
    await response.write_eof()


@api_errors
async def tokenize(request: web.Request) -> web.Response:
    state = request.app[SERVER]
    renderer = request.app[RENDERER]
    raw = await request.read()
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ApiError(f"malformed JSON body: {exc}") from None
    chat = isinstance(body, dict) and "messages" in body
    req = validate(TokenizeChatRequest if chat else TokenizeCompletionRequest, body)
    check_model(req.model, state.model_name)
    if chat:
        if req.continue_final_message:
            raise ApiError("continue_final_message is not supported", "continue_final_message")
        ids = renderer.render_messages(
            template_messages(req.messages),
            req.template_tools(),
            add_generation_prompt=req.add_generation_prompt,
            template_kwargs=req.chat_template_kwargs,
        )
    else:
        ids = renderer.encode(req.prompt, add_special_tokens=req.add_special_tokens)
    return web.json_response(
        {
            "count": len(ids),
            "max_model_len": state.limits.max_model_len,
            "tokens": ids,
            "token_strs": renderer.token_strings(ids) if req.return_token_strs else None,
        }
    )


@api_errors
async def detokenize(request: web.Request) -> web.Response:
    state = request.app[SERVER]
    req: DetokenizeRequest = await read_model(request, DetokenizeRequest)
    check_model(req.model, state.model_name)
    check_ids(req.tokens, state.limits, "tokens")
    return web.json_response({"prompt": request.app[RENDERER].decode(req.tokens)})


def add_openai_routes(app: web.Application, state_key: web.AppKey[Any]) -> None:
    """Register the OpenAI routes on the policy server's app (its state under `state_key`)."""
    app[SERVER] = app[state_key]
    app[RENDERER] = TokenizerRenderer(app[state_key].tokenizer)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/detokenize", detokenize)
