"""`/v1/completions` beyond the workers' token path: text prompts, batches, stop strings, streaming.

The server's own handler keeps the token-in/token-out path (one list of token ids, no stream,
no stop strings) exactly as the workers use it; `wants_openai_path(body)` picks the requests
it hands here instead. A batch of prompts runs as one engine request per prompt; choice `j` of
prompt `p` is returned with index `p * n + j`, as vLLM numbers them.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from aiohttp import web

from inference.openai.body import validate
from inference.openai.errors import ApiError
from inference.openai.models import TextCompletionRequest
from inference.openai.responses import OutputFormat, StreamHead, token_fields, usage
from inference.openai.schema import CompletionChoice, CompletionResponse
from inference.openai.sse import open_event_stream, sse_event
from inference.openai_generate import WatchedRequest, abort_all, check_ids, gen_params, generate
from inference.openai_routes import (
    RENDERER,
    SERVER,
    ServerView,
    api_errors,
    check_model,
    close_stream,
    count_usage,
    generated,
    served_name,
    token_namer,
)
from inference.sequence import Sequence

if TYPE_CHECKING:
    from inference.openai.render import TokenizerRenderer
    from inference.protocol import Limits


def wants_openai_path(body: Any) -> bool:
    """True for a body the token path does not take: text or batched prompts, stream, stop."""
    if not isinstance(body, dict):
        return False
    prompt = body.get("prompt")
    batched = isinstance(prompt, list) and bool(prompt) and not isinstance(prompt[0], int)
    return isinstance(prompt, str) or batched or bool(body.get("stream")) or bool(body.get("stop"))


def _prompts(
    req: TextCompletionRequest, renderer: TokenizerRenderer, limits: Limits
) -> list[list[int]]:
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
    index: int, text: str, seq: Sequence, start: int, fmt: OutputFormat, *, final: bool
) -> CompletionChoice:
    """A choice (whole, or a chunk's part from token `start` on), closing it when `final`."""
    fields = token_fields(generated(seq, start), fmt, chat=False)
    if fmt.token_ids and start == 0:
        fields["prompt_token_ids"] = list(seq.prompt)
    reason = {"finish_reason": seq.finish_reason, "stop_reason": seq.stop_reason}
    none = {"finish_reason": None}
    return CompletionChoice(index=index, text=text, **fields, **(reason if final else none))


@api_errors
async def text_completions(request: web.Request, body: Any) -> web.StreamResponse:
    """`/v1/completions` for a body `wants_openai_path` picked (already decoded)."""
    state = request.app[SERVER]
    renderer = request.app[RENDERER]
    req: TextCompletionRequest = validate(TextCompletionRequest, body)
    adapter = check_model(req.model, state)
    fmt = OutputFormat(
        token_text=token_namer(renderer, req.return_tokens_as_token_ids),
        logprobs=req.logprobs is not None,
        top_logprobs=req.logprobs or 0,
        token_ids=bool(req.return_token_ids),
        weight_versions=bool(req.return_weight_versions),
    )
    progress = asyncio.Event()
    gens = []
    for prompt in _prompts(req, renderer, state.limits):
        params = gen_params(req, len(prompt), state.limits, req.max_tokens, fmt.top_logprobs)
        stops, skip = req.stop_strings(), req.skip_special_tokens
        gens.append(
            WatchedRequest(
                prompt,
                params,
                renderer,
                stop=stops,
                skip_special_tokens=skip,
                progress=progress,
                adapter=adapter,
            )
        )
    if req.stream:
        return await _stream(request, state, req, gens, fmt)
    await generate(state.engine, gens)
    rows = [(seq, text) for gen in gens for seq, text in zip(gen.seqs, gen.texts, strict=True)]
    choices = [_choice(i, text.text, seq, 0, fmt, final=True) for i, (seq, text) in enumerate(rows)]
    prompt_tokens = sum(len(g.seqs[0].prompt) for g in gens)
    counts = usage(prompt_tokens, sum(len(seq.tokens) for seq, _ in rows))
    answer = CompletionResponse(model=served_name(gens[0], state), choices=choices, usage=counts)
    return web.json_response(text=answer.model_dump_json())


async def _stream(
    request: web.Request,
    state: ServerView,
    req: TextCompletionRequest,
    gens: list[WatchedRequest],
    fmt: OutputFormat,
) -> web.StreamResponse:
    head = StreamHead(served_name(gens[0], state), kind="text_completion")
    rows = [(seq, text) for gen in gens for seq, text in zip(gen.seqs, gen.texts, strict=True)]
    sent = [0] * len(rows)
    closed = [False] * len(rows)
    for gen in gens:
        state.engine.submit(gen)  # a refusal here is still a plain HTTP error
    try:
        response = await open_event_stream(request)
        while not all(g.done.done() for g in gens):
            await gens[0].progress.wait()  # one event shared by the batch's requests
            gens[0].progress.clear()
            for index, (seq, text) in enumerate(rows):
                if closed[index] or (sent[index] == len(seq.tokens) and seq.finish_reason is None):
                    continue
                closed[index] = seq.finish_reason is not None
                piece = text.take(final=closed[index])
                choice = _choice(index, piece, seq, sent[index], fmt, final=closed[index])
                sent[index] = len(seq.tokens)
                so_far = {"usage": count_usage(gens)} if req.continuous_usage() else {}
                chunk = CompletionResponse(**head.fields(), choices=[choice], **so_far)
                await response.write(sse_event(chunk))
        await close_stream(response, req, gens, head)
    except (asyncio.CancelledError, ConnectionResetError):
        abort_all(state.engine, gens)
        raise
    return response
