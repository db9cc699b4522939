"""vLLM 0.33's HTTP layer on a stub engine: the app the farm's clients are tested against.

Run as `python -m tests.inference.vllm_contract.stub_server --app NAME:TP:PP:DP[:API_KEY] ...`
with the contract environment (env.py) on PYTHONPATH. Each `--app` is one simulated `vllm serve`
on its own port: a FastAPI app carrying vLLM's own completion router, RL/weight-transfer router
(`entrypoints/rl/online`), `/collective_rpc`, cache and health routers, `/v1/models` and the
runtime-LoRA routes over vLLM's `OpenAIServingModels` (a completion naming a loaded adapter is
served: token i shifts by 100 x the adapter's lora_int_id, the version stays engine-wide; each
step runs vLLM's LoRA worker manager for it, see stub_engine), its exception handlers
and, with an API key, its AuthenticationMiddleware, exactly as `vllm serve` registers them in
dev mode. `/v1/completions` requests are parsed and validated by vLLM's `CompletionRequest`;
the stub handler answers with vLLM's own response models; `stream: true` is answered as 0.33's
`completion_stream_generator` sends it: one `CompletionStreamResponse` per token, dumped with
`exclude_unset`, token ids and logprobs per chunk, the weight-version spans of the whole output
on the final chunk only, then `data: [DONE]`. One more app, `validator`, checks
a JSON body against a named vLLM pydantic model (`POST /validate/{model}`) so tests can hold
the CPU server's bodies to vLLM's types. Prints `READY <name> <url>` per app, then `READY-ALL`.
"""

from __future__ import annotations

import argparse
import asyncio
import socket
from types import SimpleNamespace
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from vllm.entrypoints.openai.completion.api_router import attach_router as attach_completion
from vllm.entrypoints.openai.completion.protocol import (
    CompletionLogProbs,
    CompletionRequest,
    CompletionResponse,
    CompletionResponseChoice,
    CompletionResponseStreamChoice,
    CompletionStreamResponse,
)
from vllm.entrypoints.openai.models.api_router import attach_router as attach_models
from vllm.entrypoints.openai.models.protocol import BaseModelPath
from vllm.entrypoints.openai.models.serving import OpenAIServingModels
from vllm.entrypoints.openai.responses.protocol import ResponsesRequest, ResponsesResponse
from vllm.entrypoints.rl.factories import register_rl_api_routers
from vllm.entrypoints.serve.dev.cache.api_router import attach_router as attach_cache
from vllm.entrypoints.serve.dev.rpc.api_router import attach_router as attach_rpc
from vllm.entrypoints.serve.engine.protocol import ErrorResponse, ModelList, UsageInfo
from vllm.entrypoints.serve.exception_handling.error_response import create_error_response
from vllm.entrypoints.serve.exception_handling.register import init_exception_handler
from vllm.entrypoints.serve.instrumentator.health import router as health_router
from vllm.entrypoints.serve.lora.api_router import attach_router as attach_lora
from vllm.entrypoints.serve.middleware.authenticate import AuthenticationMiddleware
from vllm.exceptions import VLLMNotFoundError
from vllm.outputs import WeightVersionSpan
from vllm.v1.engine.exceptions import EngineDeadError

from tests.inference.vllm_contract.stub_engine import StubEngine

SERVED_MODEL = "stub-model"
VOCAB = 256


class StubServingCompletion:
    """Stands in for OpenAIServingCompletion: same call, vLLM's request and response types.

    Token i of a completion is `(sum(prompt) + i) % 256` with logprob `-(i + 1) / 100`, so
    a test knows what to expect; `max_tokens` counts, `stop_token_ids` stop (the stop token is
    included, as in vLLM), a pause(abort) cuts it short with finish reason `abort`.
    """

    def __init__(self, engine: StubEngine, models: OpenAIServingModels) -> None:
        self.engine = engine
        self.models = models

    async def create_completion(
        self, request: CompletionRequest, raw_request: Request
    ) -> CompletionResponse | ErrorResponse:
        lora = self.models.lora_requests.get(request.model or "")
        if lora is None and request.model not in (None, SERVED_MODEL):
            return create_error_response(
                VLLMNotFoundError(f"The model `{request.model}` does not exist.")
            )
        prompt = request.prompt
        if not (isinstance(prompt, list) and all(isinstance(t, int) for t in prompt)):
            return create_error_response("the stub serves one token-id prompt", param="prompt")
        try:
            await self.engine.admit()
        except Exception as exc:
            return create_error_response(exc)
        self.engine.started()
        if request.stream:
            return self._stream(request, prompt, lora)
        try:
            return await self._generate(request, prompt, lora)
        except EngineDeadError as exc:
            return create_error_response(exc)
        finally:
            self.engine.finished()

    async def _steps(self, request: CompletionRequest, prompt: list[int], lora: Any, out: Any):
        """The completion's tokens, one per engine step; `out` gets the spans and finish."""
        lora_id = lora.lora_int_id if lora is not None else 0
        for i in range(request.max_tokens or 16):
            if not await self.engine.step():
                out.finish = "abort"
                break
            if lora is not None:
                self.engine.apply_lora(lora)  # the runner's set_active_loras before a forward
            token = (sum(prompt) + i + 100 * lora_id) % VOCAB
            if out.spans and out.spans[-1].version == self.engine.version:
                out.spans[-1].end += 1
            else:
                out.spans.append(WeightVersionSpan(self.engine.version, i, i + 1))
            yield i, token
            if token in (request.stop_token_ids or []):
                out.finish, out.stop_reason = "stop", token
                break
        if lora is not None:
            self.engine.record_generation(lora)

    async def _generate(
        self, request: CompletionRequest, prompt: list[int], lora: Any
    ) -> CompletionResponse:
        out = SimpleNamespace(spans=[], finish="length", stop_reason=None)
        tokens = [token async for _, token in self._steps(request, prompt, lora, out)]
        choice = CompletionResponseChoice(
            index=0,
            text="".join(chr(t) for t in tokens),
            logprobs=_logprobs(request, tokens, 0),
            finish_reason=out.finish,
            stop_reason=out.stop_reason,
            token_ids=tokens if request.return_token_ids else None,
            prompt_token_ids=prompt if request.return_token_ids else None,
            weight_versions=out.spans if request.return_weight_versions else None,
        )
        return CompletionResponse(
            model=request.model or SERVED_MODEL,
            choices=[choice],
            usage=UsageInfo(
                prompt_tokens=len(prompt),
                completion_tokens=len(tokens),
                total_tokens=len(prompt) + len(tokens),
            ),
        )

    async def _stream(self, request: CompletionRequest, prompt: list[int], lora: Any):
        out = SimpleNamespace(spans=[], finish="length", stop_reason=None)
        model = request.model or SERVED_MODEL
        steps = self._steps(request, prompt, lora, out)

        def chunk(i: int, tokens: list[int], finish: str | None) -> str:
            choice = CompletionResponseStreamChoice(
                index=0,
                text="".join(chr(t) for t in tokens),
                logprobs=_logprobs(request, tokens, i),
                finish_reason=finish,
                stop_reason=out.stop_reason if finish else None,
                prompt_token_ids=prompt if request.return_token_ids and i == 0 else None,
                token_ids=tokens if request.return_token_ids else None,
                # 0.33's output processor labels only the finished output, all of it
                weight_versions=out.spans if finish and request.return_weight_versions else None,
            )
            body = CompletionStreamResponse(model=model, choices=[choice])
            return f"data: {body.model_dump_json(exclude_unset=True)}\n\n"

        try:
            held = None  # one token behind, so the last one goes out with the finish reason
            async for i, token in steps:
                if held is not None:
                    yield chunk(*held, None)
                held = (i, [token])
            yield chunk(*(held or (0, [])), out.finish)
        except EngineDeadError as exc:
            yield f"data: {create_error_response(exc).model_dump_json()}\n\n"
        finally:
            self.engine.finished()
        yield "data: [DONE]\n\n"


def _logprobs(request: CompletionRequest, tokens: list[int], start: int) -> Any:
    """The stub's logprobs of `tokens`, the completion's tokens from index `start` on (token
    i's is -(i + 1) / 100), or None where the request asked for none."""
    if request.logprobs is None:
        return None
    lps = [-(start + k + 1) / 100 for k in range(len(tokens))]
    return CompletionLogProbs(
        text_offset=list(range(start, start + len(tokens))),
        token_logprobs=lps,
        tokens=[chr(t) for t in tokens],
        top_logprobs=[{chr(t): lp} for t, lp in zip(tokens, lps, strict=True)],
    )


def build_app(tp: int, pp: int, dp: int, api_key: str | None) -> FastAPI:
    """vLLM's dev-mode routers, handlers and middleware over a StubEngine."""
    app = FastAPI()
    app.include_router(health_router)
    attach_completion(app)
    attach_cache(app)
    attach_rpc(app)
    register_rl_api_routers(app)
    init_exception_handler(app)
    if api_key:
        app.add_middleware(AuthenticationMiddleware, tokens=[api_key])
    engine = StubEngine(tp, pp, dp)
    # The handlers read `vllm serve`'s parsed arguments; these are its defaults for them.
    app.state.args = argparse.Namespace(log_error_stack=False, sse_keep_alive_interval=0)
    app.state.engine_client = engine
    # `vllm serve --enable-lora` with VLLM_ALLOW_RUNTIME_LORA_UPDATING=1: vLLM's own model
    # registry behind /v1/models and the adapter routes
    models = OpenAIServingModels(engine, [BaseModelPath(SERVED_MODEL, "/models/stub")])
    app.state.openai_serving_models = models
    attach_models(app)
    attach_lora(app)
    app.state.openai_serving_completion = StubServingCompletion(engine, models)

    @app.get("/_stub/state")  # outside vLLM's surface: what the engine saw, for assertions
    async def stub_state() -> dict[str, Any]:
        return {
            "calls": engine.calls,
            "version": engine.version,
            "reloaded": engine.reloaded,
            "cache_resets": engine.cache_resets,
            "loras": engine.loras,
            "generated_with": engine.generated_with,
            "dead": engine.dead,
        }

    return app


def build_validator() -> FastAPI:
    models = {
        "CompletionResponse": CompletionResponse,
        "CompletionResponseChoice": CompletionResponseChoice,
        "ErrorResponse": ErrorResponse,
        "ModelList": ModelList,
        "ResponsesRequest": ResponsesRequest,
        "ResponsesResponse": ResponsesResponse,
    }
    app = FastAPI()

    @app.post("/validate/{name}")
    async def validate(name: str, request: Request) -> JSONResponse:
        """`ok` when the model accepts the body; `extra`: top-level keys it does not declare."""
        body = await request.json()
        model = models[name]
        extra = sorted(set(body) - set(model.model_fields)) if isinstance(body, dict) else []
        try:
            model.model_validate(body)
        except ValidationError as exc:
            errors = exc.errors(include_url=False, include_context=False)
            return JSONResponse({"ok": False, "errors": repr(errors), "extra": extra})
        return JSONResponse({"ok": True, "extra": extra})

    return app


async def serve(apps: dict[str, FastAPI]) -> None:
    servers = []
    for name, app in apps.items():
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        # listening before READY: a client may connect before uvicorn's task reaches serve()
        sock.listen(128)
        config = uvicorn.Config(app, log_level="warning", lifespan="off")
        server = uvicorn.Server(config)
        servers.append((server, sock))
        print(f"READY {name} http://127.0.0.1:{sock.getsockname()[1]}", flush=True)
    print("READY-ALL", flush=True)
    async with asyncio.TaskGroup() as group:
        for server, sock in servers:
            group.create_task(server.serve(sockets=[sock]), name=f"uvicorn-{sock.getsockname()}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--app", action="append", default=[], help="NAME:TP:PP:DP[:API_KEY]")
    args = parser.parse_args()
    apps: dict[str, FastAPI] = {"validator": build_validator()}
    for spec in args.app:
        name, tp, pp, dp, *key = spec.split(":")
        apps[name] = build_app(int(tp), int(pp), int(dp), key[0] if key else None)
    asyncio.run(serve(apps))


if __name__ == "__main__":
    main()
