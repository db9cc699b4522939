"""vLLM 0.33's runtime LoRA routes on the CPU policy server: `/v1/load_lora_adapter` and
`/v1/unload_lora_adapter`, mounted only with `enable_lora` (vLLM mounts them only with
`VLLM_ALLOW_RUNTIME_LORA_UPDATING=1`; without it they are 404).

Shapes and answers follow `vllm/entrypoints/serve/lora/` and `openai/models/serving.py`:
request bodies `LoadLoRAAdapterRequest {lora_name, lora_path, load_inplace, is_3d_lora_weight}`
and `UnloadLoRAAdapterRequest {lora_name, lora_int_id}`; success is HTTP 200 with a plain-text
body (`Success: LoRA adapter '<name>' added successfully.`), a refusal is vLLM's ErrorResponse:
400 for a missing name or path, a name that is the base model's, or a name already loaded
without `load_inplace`; 404 for a path with no adapter (`Loading lora <name> failed: No adapter
found for <path>`) and for unloading a name not loaded (`The lora adapter '<name>' cannot be
found.`). Refusals of the registry's own checks have type `InvalidUserInput`, as in vLLM.
Two differences: vLLM replaces file paths in error messages by `<path>`, the CPU server keeps
them; and an adapter vLLM's loader rejects (rank above `--max-lora-rank`, DoRA,
a bad config) is a 500 there and a 400 here, with the same message (bad input is never a 500
on this server).

As in vLLM, unloading only removes the name: requests already running under the adapter finish
with it (their sequences hold the adapter), and a request naming it afterwards gets the 404 of
an unknown model.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from aiohttp import web
from pydantic import BaseModel, ValidationError

from inference.protocol import ProtocolError, error_body


class LoadLoRAAdapterRequest(BaseModel):
    """vLLM 0.33's request model (serve/lora/protocol.py)."""

    lora_name: str
    lora_path: str
    load_inplace: bool = False
    is_3d_lora_weight: bool = False


class UnloadLoRAAdapterRequest(BaseModel):
    """vLLM 0.33's request model (serve/lora/protocol.py)."""

    lora_name: str
    lora_int_id: int | None = None


M = TypeVar("M", bound=BaseModel)


def _parse(model: type[M], body: Any) -> M:
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        err = exc.errors()[0]
        param = ".".join(str(p) for p in err["loc"])
        raise ProtocolError(f"{param}: {err['msg']}", param) from None


def _invalid(message: str) -> web.Response:
    """vLLM's 400 for a request its model registry refuses (type `InvalidUserInput`)."""
    return web.json_response(error_body(message, 400, kind="InvalidUserInput"), status=400)


def add_lora_routes(
    app: web.Application,
    key: web.AppKey,
    read_json: Callable[..., Awaitable[Any]],
) -> None:
    """Register the two routes; `key` finds the ServerState (`.engine.lora`, `.model_name`)."""
    lock = asyncio.Lock()  # loads and unloads one at a time: no two loads race on one name

    async def load(request: web.Request) -> web.Response:
        state = request.app[key]
        table = state.engine.lora
        req = _parse(LoadLoRAAdapterRequest, await read_json(request))
        name = req.lora_name
        async with lock:
            if not name or not req.lora_path:
                return _invalid("Both 'lora_name' and 'lora_path' must be provided.")
            if name == state.model_name:
                return _invalid(f"The lora adapter '{name}' conflicts with a served base model.")
            if not req.load_inplace and name in table.loaded:
                return _invalid(
                    f"The lora adapter '{name}' has already been loaded. If you want to load "
                    "the adapter in place, set 'load_inplace' to True."
                )
            adapter = await asyncio.to_thread(table.read, name, req.lora_path)
            await state.engine.add_adapter(adapter)
        return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")

    async def unload(request: web.Request) -> web.Response:
        table = request.app[key].engine.lora
        req = _parse(UnloadLoRAAdapterRequest, await read_json(request))
        name = req.lora_name
        async with lock:
            if not name:
                return _invalid("'lora_name' needs to be provided to unload a LoRA adapter.")
            if name not in table.loaded:
                return web.json_response(
                    error_body(f"The lora adapter '{name}' cannot be found.", 404), status=404
                )
            del table.loaded[name]
        return web.Response(text=f"Success: LoRA adapter '{name}' removed successfully.")

    app.router.add_post("/v1/load_lora_adapter", load)
    app.router.add_post("/v1/unload_lora_adapter", unload)
