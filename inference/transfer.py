"""vLLM 0.33's NCCL weight-transfer routes, received over a gloo group as vLLM's worker does over NCCL.

vLLM (dev mode, `--weight-transfer-config '{"backend": "nccl"}'`) exposes
`/init_weight_transfer_engine {"init_info": {...}}`, `/start_weight_update`,
`/update_weights {"update_info": {"names", "dtype_names", "shapes"}}`,
`/finish_weight_update {"weight_version": ...}` and `/shutdown_weight_transfer_engine`. The CPU
server answers the same routes with the same bodies, and moves the tensors the same way
(`vllm/distributed/weight_transfer/nccl_engine.py`): on init the engine joins the trainer's
group with rank `rank_offset` (one worker: TP = PP = DP = 1); on update it allocates
`torch.empty(shape, dtype)` per name and receives each by `broadcast(src=0)` in `names` order
(empty lists reuse the previous call's, as in 0.33). Only the communicator differs: gloo
(`inference.nccl.GlooCommunicator`) in place of PyNcclCommunicator, and packed transfers and
`nccl_unique_id_b64` rendezvous are refused (they need vLLM's NCCL code).

Two choices go beyond vLLM, so that a failed transfer never half-changes the server: the
received tensors are staged, and `/finish_weight_update` loads them together with the new
version label (all-or-nothing); and any failed `/update_weights` (bad metadata, a trainer that
died mid-broadcast, a timeout) closes the group, so the trainer's broadcast fails at once. The
server keeps serving its old weights under its old label and answers a clear error; the
trainer forms a new group with `/init_weight_transfer_engine`. Receives and group formation
run in a thread, so the event loop keeps serving.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import torch
from aiohttp import web

from inference.errors import EngineError
from inference.nccl import GlooCommunicator
from inference.protocol import ProtocolError

if TYPE_CHECKING:
    from inference.engine import Engine

# vLLM 0.33's NCCLWeightTransferInitInfo and NCCLWeightTransferUpdateInfo fields.
INIT_FIELDS = frozenset(
    {
        "master_address",
        "master_port",
        "rank_offset",
        "world_size",
        "nccl_unique_id_b64",
        "packed",
        "packed_buffer_size_bytes",
        "packed_num_buffers",
    }
)
UPDATE_FIELDS = frozenset({"names", "dtype_names", "shapes"})


UpdateMeta = tuple[list[str], list[torch.dtype], list[list[int]]]  # names, dtypes, shapes


@dataclasses.dataclass
class TransferState:
    """Where the transfer session stands: the group, an update in progress, staged tensors."""

    timeout_s: float = 60.0  # limit on forming the group and on each broadcast
    group: GlooCommunicator | None = None
    busy: str | None = None  # "joining" or "receiving" while a thread holds the group
    updating: bool = False
    last_update: UpdateMeta | None = None
    staged: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)

    def close(self) -> None:
        """Leave the group and forget the session (its staged tensors too)."""
        group, self.group = self.group, None
        self.updating, self.last_update, self.staged = False, None, {}
        if group is not None:
            group.destroy()


class TransferHost(Protocol):
    """What the transfer routes use of the server's state (server.py imports this module)."""

    transfer: TransferState
    engine: Engine


H = TypeVar("H", bound=TransferHost)


def _conflict(message: str) -> EngineError:
    return EngineError(message, status=409)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def parse_init_info(info: Any) -> tuple[str, int, int, int]:
    """(master_address, master_port, rank, world_size) of this one-worker server."""
    if not isinstance(info, dict):
        raise ProtocolError("Missing 'init_info' in request body", "init_info")
    unknown = sorted(set(info) - INIT_FIELDS)
    if unknown:
        raise ProtocolError(f"Invalid init_info: unexpected fields {unknown}", "init_info")
    if info.get("nccl_unique_id_b64") or info.get("packed"):
        raise ProtocolError(
            "the CPU server receives unpacked over master_address/master_port "
            "(packed and nccl_unique_id_b64 need vLLM's NCCL engine)",
            "init_info",
        )
    address, port = info.get("master_address"), info.get("master_port")
    rank, world = info.get("rank_offset"), info.get("world_size")
    if not (isinstance(address, str) and address and _is_int(port) and 0 < port < 65536):
        raise ProtocolError("init_info needs master_address and master_port", "init_info")
    if not (_is_int(rank) and _is_int(world) and 1 <= rank < world):
        raise ProtocolError(
            f"init_info needs 1 <= rank_offset < world_size, got {rank!r} and {world!r}",
            "init_info",
        )
    return address, port, rank, world


def parse_update_info(info: Any, model_state: dict[str, torch.Tensor]) -> UpdateMeta:
    """Names, dtypes and shapes, each checked against the model (nothing is received yet)."""
    if not isinstance(info, dict):
        raise ProtocolError("Missing 'update_info' in request body", "update_info")
    unknown = sorted(set(info) - UPDATE_FIELDS)
    if unknown:
        raise ProtocolError(f"Invalid update_info: unexpected fields {unknown}", "update_info")
    names, dtypes, shapes = (
        info.get("names", []),
        info.get("dtype_names", []),
        info.get("shapes", []),
    )
    if not (isinstance(names, list) and isinstance(dtypes, list) and isinstance(shapes, list)):
        raise ProtocolError("update_info needs lists names, dtype_names, shapes", "update_info")
    if not len(names) == len(dtypes) == len(shapes):
        raise ProtocolError("names, dtype_names and shapes differ in length", "update_info")
    if len(set(map(str, names))) != len(names):
        raise ProtocolError("update_info names a tensor twice", "update_info")
    torch_dtypes = []
    for name, dtype, shape in zip(names, dtypes, shapes, strict=True):
        torch_dtype = getattr(torch, dtype, None) if isinstance(dtype, str) else None
        if not isinstance(torch_dtype, torch.dtype):
            raise ProtocolError(f"tensor {name!r} has unknown dtype {dtype!r}", "update_info")
        if not isinstance(name, str) or name not in model_state:
            raise ProtocolError(f"tensor {name!r} is not in the model", "update_info")
        if not isinstance(shape, list) or shape != list(model_state[name].shape):
            raise ProtocolError(
                f"tensor {name!r} with shape {shape} does not match the model's "
                f"{list(model_state[name].shape)}",
                "update_info",
            )
        torch_dtypes.append(torch_dtype)
    return names, torch_dtypes, shapes


def receive(
    group: GlooCommunicator,
    names: list[str],
    dtypes: list[torch.dtype],
    shapes: list[list[int]],
    into: dict[str, torch.Tensor],
) -> None:
    """vLLM's unpacked receive: one broadcast from rank 0 per name, in `names` order."""
    for name, dtype, shape in zip(names, dtypes, shapes, strict=True):
        tensor = torch.empty(shape, dtype=dtype)
        group.broadcast(tensor, src=0)
        into[name] = tensor


def add_transfer_routes(
    app: web.Application,
    key: web.AppKey[H],
    read_json: Callable[..., Awaitable[Any]],
    json_object: Callable[[Any], dict[str, Any]],
) -> None:
    """Register the transfer routes and /get_world_size; `key` finds the ServerState holding `.transfer` and `.engine`."""

    async def init_engine(request: web.Request) -> web.Response:
        transfer = request.app[key].transfer
        body = json_object(await read_json(request))
        address, port, rank, world = parse_init_info(body.get("init_info"))
        if transfer.busy or transfer.updating:
            raise _conflict(f"cannot form a new group while {transfer.busy or 'updating'}")
        transfer.close()
        transfer.busy = "joining"
        try:
            transfer.group = await _join(address, port, rank, world, transfer.timeout_s)
        except Exception as exc:  # torch raises RuntimeError subclasses and TimeoutError
            raise EngineError(f"weight transfer group not formed: {exc}", status=500) from exc
        finally:
            transfer.busy = None
        return web.json_response({"message": "Weight transfer initialized"})

    async def start_update(request: web.Request) -> web.Response:
        transfer = request.app[key].transfer
        if transfer.group is None or transfer.busy:
            raise _conflict("weight transfer engine is not initialised")
        transfer.updating, transfer.staged = True, {}
        return web.json_response({"message": "Weight update started"})

    async def update_weights(request: web.Request) -> web.Response:
        state = request.app[key]
        transfer: TransferState = state.transfer
        if not transfer.updating or transfer.group is None or transfer.busy:
            raise _conflict("no weight update in progress (call /start_weight_update)")
        body = json_object(await read_json(request))
        try:
            info = body.get("update_info")
            if isinstance(info, dict) and not any(info.get(f) for f in UPDATE_FIELDS):
                if transfer.last_update is None:
                    raise EngineError("empty update_info but no previous one to reuse")
                meta = transfer.last_update  # vLLM 0.33: empty lists reuse the previous call's
            else:
                meta = parse_update_info(info, state.engine.model.state_dict())
            await _receive(transfer, meta, state.engine.version)
        except BaseException:
            transfer.close()  # the trainer is broadcasting into a group this server left
            raise
        return web.json_response({"message": "Weights updated"})

    app.router.add_get("/get_world_size", world_size)
    app.router.add_post("/init_weight_transfer_engine", init_engine)
    app.router.add_post("/start_weight_update", start_update)
    app.router.add_post("/update_weights", update_weights)
    app.router.add_post("/finish_weight_update", _finish_route(key, read_json, json_object))
    app.router.add_post("/shutdown_weight_transfer_engine", _shutdown_route(key))


async def _join(
    address: str, port: int, rank: int, world: int, timeout_s: float
) -> GlooCommunicator:
    """Form the group in a thread; if the caller goes away first, leave it once it forms."""
    joining = asyncio.ensure_future(
        asyncio.to_thread(GlooCommunicator, address, port, rank, world, timeout_s)
    )
    try:
        return await asyncio.shield(joining)
    except asyncio.CancelledError:
        joining.add_done_callback(
            lambda f: f.cancelled() or f.exception() is not None or f.result().destroy()
        )
        raise


async def _receive(transfer: TransferState, meta: UpdateMeta, version: str) -> None:
    names, dtypes, shapes = meta
    got: dict[str, torch.Tensor] = {}
    transfer.busy = "receiving"
    try:
        await asyncio.to_thread(receive, transfer.group, names, dtypes, shapes, got)  # type: ignore[arg-type]
    except Exception as exc:  # gloo raises RuntimeError: peer gone, timeout, size mismatch
        raise EngineError(
            f"weight transfer failed after {len(got)} of {len(names)} tensors: {exc}; "
            f"still serving version {version!r}; the group is closed "
            "(call /init_weight_transfer_engine again)",
            status=500,
        ) from exc
    finally:
        transfer.busy = None
    transfer.last_update = meta
    transfer.staged |= got


def _finish_route(
    key: web.AppKey[H],
    read_json: Callable[..., Awaitable[Any]],
    json_object: Callable[[Any], dict[str, Any]],
) -> Any:
    async def finish_update(request: web.Request) -> web.Response:
        state = request.app[key]
        transfer: TransferState = state.transfer
        if not transfer.updating or transfer.busy:
            raise _conflict("no weight update in progress")
        body = json_object(await read_json(request, allow_empty=True))
        label = body.get("weight_version")
        if label is not None and not isinstance(label, str | int):
            raise ProtocolError("weight_version must be a string", "weight_version")
        staged, transfer.staged, transfer.updating = transfer.staged, {}, False
        if staged:  # weights and label change together, or neither does
            await state.engine.load_weights(staged, complete=False)
        if label is not None:
            state.engine.set_version(str(label))
        return web.json_response({"message": "Weight update finished"})

    return finish_update


def _shutdown_route(key: web.AppKey[H]) -> Any:
    async def shutdown(request: web.Request) -> web.Response:
        transfer: TransferState = request.app[key].transfer
        if transfer.busy or transfer.updating:
            raise _conflict("Cannot release a trainer connection during a weight update")
        transfer.close()
        return web.json_response({"message": "Weight transfer shut down"})

    return shutdown


async def world_size(request: web.Request) -> web.Response:
    # vLLM 0.33 answers TP x PP (x DP with include_dp); this server is one CPU worker.
    return web.json_response({"world_size": 1})
