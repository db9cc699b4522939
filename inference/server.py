"""The CPU policy server: vLLM's token-in/token-out completion route and RL control routes over aiohttp.

`PolicyServer(config)` loads the model, starts the engine loop and listens; `stop()` closes it.
Routes (shapes from vLLM's `serve/dev/rlhf`, `serve/dev/rpc` and `serve/cache` routers):
`/v1/completions`, `/v1/models`, `/health`, `/metrics`, `/pause?mode=abort|wait|keep`, `/resume`,
`/is_paused`, `/collective_rpc` (method `reload_weights`), `/update_weight_version`,
`/weight_info`, `/reset_prefix_cache`, with `enable_lora` the LoRA routes (`lora_routes.py`;
a request whose `model` names a loaded adapter generates with it), and the NCCL weight-transfer routes, whose tensors
arrive over a gloo group as vLLM's worker receives them over NCCL (see `transfer.py`). Every error is JSON in vLLM's ErrorResponse shape;
bad input is a 4xx, never a 500. With an API key, every route except /health and /metrics
needs `Authorization: Bearer <key>` (vLLM guards only /v1; we also guard the control routes).
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from pathlib import Path
from typing import Any

import torch
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import SecretStr
from transformers import AutoModelForCausalLM, AutoTokenizer

from inference import metrics
from inference.config import ServerConfig
from inference.engine import Engine, GenRequest
from inference.errors import EngineError
from inference.lora import AdapterTable, LoraAdapter
from inference.lora_routes import add_lora_routes
from inference.openai.body import json_body, json_object
from inference.openai.errors import ApiError
from inference.openai_completions import text_completions, wants_openai_path
from inference.openai_routes import add_openai_routes
from inference.prefix_cache import PrefixCache
from inference.protocol import (
    Limits,
    ProtocolError,
    completion_response,
    error_body,
    parse_completion,
)
from inference.transfer import TransferState, add_transfer_routes

log = logging.getLogger(__name__)

OPEN_ROUTES = frozenset({"/health", "/metrics"})
STATE = web.AppKey["ServerState"]("state")  # subscripted: the class is defined below


class ServerState:
    """What the handlers share: the engine, tokenizer, limits and names."""

    def __init__(
        self, config: ServerConfig, engine: Engine, tokenizer: Any, vocab_size: int
    ) -> None:
        self.config = config
        self.engine = engine
        self.tokenizer = tokenizer
        self.model_name = config.served_model_name or Path(config.model).name
        self.limits = Limits(vocab_size, engine.max_model_len, config.max_n)
        self.transfer = TransferState(timeout_s=config.weight_transfer_timeout_s)
        self.created = int(time.time())

    def adapter(self, name: str) -> LoraAdapter | None:
        """The loaded LoRA adapter served as `name`, if any."""
        return self.engine.lora.loaded.get(name) if self.engine.lora is not None else None


def load_engine(config: ServerConfig) -> tuple[Engine, Any, int]:
    """Load model and tokenizer from the directory; nothing is fetched from a hub."""
    model = AutoModelForCausalLM.from_pretrained(
        config.model, dtype=torch.float32, local_files_only=True
    )
    tokenizer = AutoTokenizer.from_pretrained(config.model, local_files_only=True)
    eos = model.generation_config.eos_token_id if model.generation_config else None
    eos_ids = {eos} if isinstance(eos, int) else set(eos or ())
    if tokenizer.eos_token_id is not None:
        eos_ids.add(tokenizer.eos_token_id)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(eos_ids, default=0)
    engine = Engine(
        model,
        eos_ids=frozenset(eos_ids),
        pad_id=pad,
        max_model_len=config.max_model_len or model.config.max_position_embeddings,
        max_batch=config.max_batch_size,
        batch_window_s=config.batch_window_ms / 1000,
        version=config.weight_version,
        prefix_cache=PrefixCache(int(config.kv_cache_mb * 2**20)),
        lora=AdapterTable(model, config.max_lora_rank, config.max_loras)
        if config.enable_lora
        else None,
    )
    return engine, tokenizer, model.config.vocab_size


async def read_json(request: web.Request, *, allow_empty: bool = False) -> Any:
    """The decoded JSON body; a malformed one is an ApiError (HTTP 400)."""
    return json_body(await request.read(), allow_empty=allow_empty)


@web.middleware
async def errors_and_metrics(request: web.Request, handler: Any) -> web.StreamResponse:
    route = (
        request.match_info.route.resource.canonical
        if request.match_info.route.resource
        else "unmatched"
    )
    try:
        response = await handler(request)
    except ProtocolError as exc:
        response = web.json_response(error_body(exc.message, 400, exc.param), status=400)
    except ApiError as exc:  # a malformed body or a bad field (inference.openai.body)
        response = web.json_response(exc.body(), status=exc.status)
    except EngineError as exc:
        response = web.json_response(error_body(str(exc), exc.status), status=exc.status)
    except web.HTTPException as exc:
        response = web.json_response(error_body(exc.reason, exc.status), status=exc.status)
    except Exception as exc:  # the server must answer, never die; logged with its traceback
        log.exception("unhandled error on %s", request.path)
        response = web.json_response(error_body(f"internal error: {exc}", 500), status=500)
    metrics.REQUESTS.labels(route=route, code=str(response.status)).inc()
    return response


def _secret(value: SecretStr | None) -> str | None:
    return value.get_secret_value() if value is not None else None


def auth_middleware(api_key: str | None) -> Any:
    expected = f"Bearer {api_key}".encode() if api_key else None

    @web.middleware
    async def check(request: web.Request, handler: Any) -> web.StreamResponse:
        if expected is not None and request.path not in OPEN_ROUTES:
            given = request.headers.get("Authorization", "").encode()
            if not hmac.compare_digest(given, expected):
                return web.json_response({"error": "Unauthorized"}, status=401)  # vLLM's body
        return await handler(request)

    return check


async def completions(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    started = time.perf_counter()
    body = await read_json(request)
    if wants_openai_path(body):  # text prompts, batches, stop strings, streaming
        return await text_completions(request, body)
    req, prompt, params = parse_completion(body, state.limits)
    adapter = None
    if req.model is not None and req.model != state.model_name:
        adapter = state.adapter(req.model)
        if adapter is None:
            return web.json_response(
                error_body(f"The model `{req.model}` does not exist.", 404, "model"), status=404
            )
    gen = GenRequest(prompt, params, adapter)
    state.engine.submit(gen)
    try:
        await asyncio.shield(gen.done)
    except asyncio.CancelledError:  # client went away: free the batch slot, then keep cancelling
        state.engine.abort(gen)
        raise
    metrics.REQUEST_SECONDS.observe(time.perf_counter() - started)
    name = adapter.name if adapter is not None else state.model_name
    return web.json_response(completion_response(req, gen, name, state.tokenizer))


async def models(request: web.Request) -> web.Response:
    state = request.app[STATE]
    card = {
        "id": state.model_name,
        "object": "model",
        "created": state.created,
        "owned_by": "rollout-farm",
        "root": str(state.config.model),
        "parent": None,
        "max_model_len": state.engine.max_model_len,
    }
    lora = state.engine.lora
    adapters = [
        {  # vLLM's card of an adapter: its path as root, the base model as parent
            "id": adapter.name,
            "object": "model",
            "created": state.created,
            "owned_by": "rollout-farm",
            "root": adapter.path,
            "parent": state.model_name,
            "max_model_len": None,
        }
        for adapter in (lora.loaded.values() if lora is not None else ())
    ]
    return web.json_response({"object": "list", "data": [card, *adapters]})


async def health(request: web.Request) -> web.Response:
    return web.Response(status=200)


async def prometheus(request: web.Request) -> web.Response:
    return web.Response(body=generate_latest(), headers={"Content-Type": CONTENT_TYPE_LATEST})


async def pause(request: web.Request) -> web.Response:
    mode = request.query.get("mode", "abort")
    if request.query.get("wait_for_inflight_requests", "false").lower() == "true":
        mode = "wait"  # vLLM's deprecated spelling of mode=wait
    if mode not in ("abort", "wait", "keep"):
        raise ProtocolError(f"mode must be abort, wait or keep, not {mode!r}", "mode")
    clear_cache = request.query.get("clear_cache", "true").lower() != "false"
    await request.app[STATE].engine.pause(mode, clear_cache)
    return web.json_response({"status": "paused"})


async def resume(request: web.Request) -> web.Response:
    request.app[STATE].engine.resume()
    return web.json_response({"status": "resumed"})


async def is_paused(request: web.Request) -> web.Response:
    return web.json_response({"is_paused": request.app[STATE].engine.paused})


async def collective_rpc(request: web.Request) -> web.Response:
    body = json_object(await read_json(request))
    method = body.get("method")
    if method is None:
        raise ProtocolError("Missing 'method' in request body", "method")
    if method != "reload_weights":
        raise ProtocolError(f"method {method!r} is not supported (only reload_weights)", "method")
    kwargs = body.get("kwargs", {})
    if not isinstance(kwargs, dict) or not isinstance(kwargs.get("weights_path"), str):
        raise ProtocolError("reload_weights needs kwargs.weights_path (a string)", "kwargs")
    await request.app[STATE].engine.reload_weights(Path(kwargs["weights_path"]))
    return web.json_response({"results": [None]})


async def update_weight_version(request: web.Request) -> web.Response:
    body = json_object(await read_json(request))
    label = body.get("new_version")
    if isinstance(label, int) and not isinstance(label, bool):
        label = str(label)  # vLLM takes a string; an integer is accepted for convenience
    if not isinstance(label, str) or not label:
        raise ProtocolError("new_version must be a non-empty string", "new_version")
    request.app[STATE].engine.set_version(label)
    return web.json_response({"success": True, "new_version": label})


async def weight_info(request: web.Request) -> web.Response:
    return web.json_response({"weight_version": request.app[STATE].engine.version})


async def reset_prefix_cache(request: web.Request) -> web.Response:
    await request.app[STATE].engine.reset_prefix_cache()
    return web.json_response({"success": True})  # vLLM 0.33's body


def build_app(state: ServerState) -> web.Application:
    app = web.Application(
        middlewares=[errors_and_metrics, auth_middleware(_secret(state.config.api_key))]
    )
    app[STATE] = state
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", prometheus)
    app.router.add_post("/pause", pause)
    app.router.add_post("/resume", resume)
    app.router.add_get("/is_paused", is_paused)
    app.router.add_post("/collective_rpc", collective_rpc)
    app.router.add_post("/update_weight_version", update_weight_version)
    app.router.add_get("/weight_info", weight_info)
    app.router.add_post("/reset_prefix_cache", reset_prefix_cache)
    add_transfer_routes(app, STATE, read_json, json_object)
    add_openai_routes(app, STATE)
    if state.config.enable_lora:
        add_lora_routes(app, STATE, read_json)
    return app


class PolicyServer:
    """A running server: `await start()`, `url`, `await stop()` (also `async with`)."""

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.state: ServerState | None = None
        self.url = ""
        self._runner: web.AppRunner | None = None
        self._engine_task: asyncio.Task[None] | None = None

    async def start(self) -> PolicyServer:
        engine, tokenizer, vocab = await asyncio.to_thread(load_engine, self.config)
        self.state = ServerState(self.config, engine, tokenizer, vocab)
        self._runner = web.AppRunner(
            build_app(self.state), handler_cancellation=True, access_log=None
        )
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.config.host, self.config.port)
        await site.start()
        port = self._runner.addresses[0][1]
        self.url = f"http://{self.config.host}:{port}"
        self._engine_task = asyncio.create_task(engine.run(), name="inference-engine-loop")
        log.info("policy server listening on %s (model %s)", self.url, self.state.model_name)
        return self

    async def wait(self) -> None:
        """Return only if the engine loop dies (it raises); used by the CLI."""
        assert self._engine_task is not None
        await self._engine_task

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
        if self.state is not None:
            self.state.transfer.close()
        if self._engine_task is not None:
            self._engine_task.cancel()
            await asyncio.gather(self._engine_task, return_exceptions=True)

    async def __aenter__(self) -> PolicyServer:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()
