"""The NCCL weight-transfer routes of vLLM, answered on CPU by a file stand-in transport.

vLLM (dev mode) exposes `/init_weight_transfer_engine {"init_info": {...}}`,
`/start_weight_update`, `/update_weights {"update_info": {"names", "dtype_names", "shapes", ...}}`
and `/finish_weight_update {"weight_version": ...}`; between start and finish the tensors arrive
by NCCL broadcast from the trainer. The CPU server has no NCCL: it keeps the same route sequence,
bodies, session checks (409 when out of order) and metadata validation, and receives the tensors
from a safetensors file named by `update_info["cpu_weights_path"]` (a field vLLM does not have).
What is tested with it is the HTTP sequence and the all-or-nothing load, not NCCL itself.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aiohttp import web

from inference.errors import EngineError

NCCL_INIT_KEYS = ("master_address", "master_port", "rank_offset", "world_size")


@dataclass
class TransferState:
    """Where the transfer session stands: not initialised, initialised, or mid-update."""

    init_info: dict[str, Any] | None = None
    updating: bool = False


def _conflict(message: str) -> EngineError:
    return EngineError(message, status=409)


def add_transfer_routes(
    app: web.Application,
    key: web.AppKey,
    read_json: Callable[..., Awaitable[Any]],
    json_object: Callable[[Any], dict[str, Any]],
) -> None:
    """Register the transfer routes and /get_world_size; `key` finds the ServerState holding `.transfer` and `.engine`."""
    from inference.protocol import ProtocolError  # a sibling module; avoids an import cycle

    async def init_engine(request: web.Request) -> web.Response:
        body = json_object(await read_json(request))
        info = body.get("init_info")
        if not isinstance(info, dict):
            raise ProtocolError("Missing 'init_info' in request body", "init_info")
        missing = [k for k in NCCL_INIT_KEYS if k not in info]
        if missing:
            raise ProtocolError(f"init_info lacks {missing}", "init_info")
        request.app[key].transfer.init_info = info
        return web.json_response({"message": "Weight transfer initialized"})

    async def start_update(request: web.Request) -> web.Response:
        transfer = request.app[key].transfer
        if transfer.init_info is None:
            raise _conflict("weight transfer engine is not initialised")
        transfer.updating = True
        return web.json_response({"message": "Weight update started"})

    async def update_weights(request: web.Request) -> web.Response:
        state = request.app[key]
        if not state.transfer.updating:
            raise _conflict("no weight update in progress (call /start_weight_update)")
        body = json_object(await read_json(request))
        info = body.get("update_info")
        if not isinstance(info, dict):
            raise ProtocolError("Missing 'update_info' in request body", "update_info")
        names, dtypes, shapes = info.get("names"), info.get("dtype_names"), info.get("shapes")
        if not (isinstance(names, list) and isinstance(dtypes, list) and isinstance(shapes, list)):
            raise ProtocolError("update_info needs lists names, dtype_names, shapes", "update_info")
        if not len(names) == len(dtypes) == len(shapes):
            raise ProtocolError("names, dtype_names and shapes differ in length", "update_info")
        path = info.get("cpu_weights_path")
        if not isinstance(path, str):
            raise ProtocolError(
                "the CPU server needs update_info.cpu_weights_path (no NCCL)", "update_info"
            )
        model_state = state.engine.model.state_dict()
        for name, shape in zip(names, shapes, strict=True):
            if name not in model_state or list(model_state[name].shape) != list(shape):
                raise ProtocolError(
                    f"tensor {name!r} with shape {shape} is not in the model", "update_info"
                )
        await state.engine.reload_weights(Path(path))
        return web.json_response({"message": "Weights updated"})

    async def finish_update(request: web.Request) -> web.Response:
        state = request.app[key]
        if not state.transfer.updating:
            raise _conflict("no weight update in progress")
        body = json_object(await read_json(request, allow_empty=True))
        label = body.get("weight_version")
        if label is not None and not isinstance(label, str | int):
            raise ProtocolError("weight_version must be a string", "weight_version")
        state.transfer.updating = False
        if label is not None:
            state.engine.set_version(str(label))
        return web.json_response({"message": "Weight update finished"})

    async def world_size(request: web.Request) -> web.Response:
        # vLLM 0.33 answers TP x PP (x DP with include_dp); this server is one CPU worker.
        return web.json_response({"world_size": 1})

    app.router.add_get("/get_world_size", world_size)
    app.router.add_post("/init_weight_transfer_engine", init_engine)
    app.router.add_post("/start_weight_update", start_update)
    app.router.add_post("/update_weights", update_weights)
    app.router.add_post("/finish_weight_update", finish_update)
