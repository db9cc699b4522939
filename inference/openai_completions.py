"""`/v1/completions` beyond the workers' token path: text prompts, batches, stop strings, streaming.

The server's own handler keeps the token-in/token-out path (one list of token ids, no stream,
no stop strings) exactly as the workers use it; `wants_openai_path(body)` picks the requests
it hands here instead. A batch of prompts runs as one engine request per prompt; choice `j` of
prompt `p` is returned with index `p * n + j`, as vLLM numbers them.
"""

from __future__ import annotations

import asyncio
from typing import Any

from aiohttp import web

from inference.engine import Sequence
from inference.openai.errors import ApiError
from inference.openai.models import TextCompletionRequest
from inference.openai.responses import envelope, legacy_logprobs, usage, version_spans
from inference.openai.sse import open_event_stream, sse_event
from inference.openai.text import ChoiceText
from inference.openai_generate import WatchedRequest, abort_all, check_ids, gen_params, generate
from inference.openai_routes import (
    RENDERER,
    SERVER,
    api_errors,
    check_model,
    close_stream,
    token_namer,
    validate,
)


def wants_openai_path(body: Any) -> bool:
    """True for a body the token path does not take: text or batched prompts, stream, stop."""
    if not isinstance(body, dict):
        return False
    prompt = body.get("prompt")
    batched = isinstance(prompt, list) and bool(prompt) and not isinstance(prompt[0], int)
    return isinstance(prompt, str) or batched or bool(body.get("stream")) or bool(body.get("stop"))


def _prompts(req: TextCompletionRequest, renderer: Any, limits: Any) -> list[list[int]]:
    raw = req.prompt
    items = raw if isinstance(raw, list) and raw and not isinstance(raw[0], int) else [raw]
    prompts = []
    for item in items:
        ids = (
            renderer.encode(item, add_special_tokens=req.add_special_tokens)
            if isinstance(item, str)
            else list(item)
        )
        if not ids:
            raise ApiError("prompt must not be empty", "prompt")
        check_ids(ids, limits, "prompt")
        prompts.append(ids)
    return prompts


def _choice(
    req: TextCompletionRequest, seq: Sequence, text: ChoiceText, start: int, name: Any
) -> dict[str, Any]:
    """The fields of a choice for its tokens from `start` on (all of them when not streaming)."""
    choice: dict[str, Any] = {"logprobs": None, "finish_reason": None, "stop_reason": None}
    if req.logprobs is not None:
        end = len(seq.tokens)
        choice["logprobs"] = legacy_logprobs(
            seq.tokens[start:end], seq.logprobs[start:end], seq.tops[start:end], name, 0
        )
    if req.return_token_ids:
        choice["token_ids"] = list(seq.tokens[start:])
        choice["prompt_token_ids"] = list(seq.prompt) if start == 0 else None
    if req.return_weight_versions:
        choice["weight_versions"] = version_spans(seq.versions[start:], start)
    return choice


@api_errors
async def text_completions(request: web.Request, body: Any) -> web.StreamResponse:
    """`/v1/completions` for a body `wants_openai_path` picked (already decoded)."""
    state = request.app[SERVER]
    renderer = request.app[RENDERER]
    req: TextCompletionRequest = validate(TextCompletionRequest, body)
    check_model(req.model, state.model_name)
    progress = asyncio.Event()
    gens = []
    for prompt in _prompts(req, renderer, state.limits):
        params = gen_params(req, len(prompt), state.limits, req.max_tokens, req.logprobs or 0)
        stops, skip = req.stop_strings(), req.skip_special_tokens
        gens.append(WatchedRequest(prompt, params, renderer, stops, skip, progress))
    name = token_namer(renderer, req.return_tokens_as_token_ids)
    if req.stream:
        return await _stream(request, state, req, gens, name)
    await generate(state.engine, gens)
    choices = []
    for gen in gens:
        for seq, text in zip(gen.seqs, gen.texts, strict=True):
            choice = _choice(req, seq, text, 0, name)
            choice |= {"finish_reason": seq.finish_reason, "stop_reason": seq.stop_reason}
            choices.append({"index": len(choices), "text": text.text} | choice)
    prompt_tokens = sum(len(g.seqs[0].prompt) for g in gens)
    completion = sum(len(s.tokens) for g in gens for s in g.seqs)
    body = envelope("text_completion", state.model_name)
    return web.json_response(body | {"choices": choices, "usage": usage(prompt_tokens, completion)})


async def _stream(
    request: web.Request, state: Any, req: TextCompletionRequest, gens: list[Any], name: Any
) -> web.StreamResponse:
    head = envelope("text_completion", state.model_name)
    rows = [(seq, text) for gen in gens for seq, text in zip(gen.seqs, gen.texts, strict=True)]
    sent = [0] * len(rows)
    closed = [False] * len(rows)
    response = await open_event_stream(request)
    try:
        for gen in gens:
            state.engine.submit(gen)
        while not all(g.done.done() for g in gens):
            await gens[0].progress.wait()
            gens[0].progress.clear()
            for index, (seq, text) in enumerate(rows):
                if closed[index] or (sent[index] == len(seq.tokens) and seq.finish_reason is None):
                    continue
                choice = _choice(req, seq, text, sent[index], name)
                sent[index] = len(seq.tokens)
                if seq.finish_reason is not None:
                    closed[index] = True
                    choice |= {"finish_reason": seq.finish_reason, "stop_reason": seq.stop_reason}
                delta = text.take(final=closed[index])
                chunk = {"index": index, "text": delta} | choice
                await response.write(sse_event(head | {"choices": [chunk], "usage": None}))
        await close_stream(response, req, gens, head)
    except (asyncio.CancelledError, ConnectionResetError):
        abort_all(state.engine, gens)
        raise
    return response
