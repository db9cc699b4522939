"""The trainer side of vLLM 0.33's NCCL weight transfer: rank layout, group join, broadcasts.

vLLM 0.33 (`vllm/distributed/weight_transfer/nccl_common.py`, `nccl_engine.py`) forms one group
of the trainer (rank 0, the only sender) and every inference worker. A server whose engine has
`TP x PP` workers per data-parallel rank and `DP` such ranks gives its worker the group rank
`rank_offset + dp_index * (TP * PP) + rank_within_dp`, so a server occupies `TP * PP * DP`
consecutive ranks starting at the `rank_offset` it is told in `/init_weight_transfer_engine`.
`rank_offsets` lays the servers out one after another behind the trainer.

The trainer joins with `nccl_common.trainer_init({master_address, master_port, world_size},
rank=0)`, which returns a `PyNcclCommunicator` over a `StatelessProcessGroup` (a TCPStore that
rank 0 hosts). Unpacked, the trainer then calls `broadcast(tensor, src=0, stream=...)` once per
tensor, in the order of `update_info["names"]`; the workers allocate `torch.empty(shape, dtype)`
from the same metadata and receive in the same order. Packed (optional, GPU only) hands the
tensors to vLLM's own `packed_nccl_broadcast_producer`; whether to pack is fixed at init
(`packed` in init_info), as in 0.33, not per update.

`NcclTransport` takes the communicator factory as a parameter, so the CPU suite runs the same
code over `GlooCommunicator`: torch.distributed's gloo group with the call shape of
`PyNcclCommunicator.broadcast`, between real processes. The CPU policy server receives over
the same class (`inference.transfer`), as vLLM's worker receives over PyNcclCommunicator.

What is sent is a `WeightStream`: the names, dtypes and shapes are announced up front (they
become `update_info`), then the tensors are produced one at a time (a learner under FSDP
gathers each as it is sent). The sender checks each produced tensor against the announcement
before broadcasting it, as vLLM's trainer engine does: a receiver sizes its buffer from the
announcement, and gloo aborts a receiving process that is sent more bytes than it expects.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
from collections.abc import Callable, Generator, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

# vLLM 0.33's packed_tensor defaults (DEFAULT_PACKED_BUFFER_SIZE_BYTES, DEFAULT_PACKED_NUM_BUFFERS).
PACKED_BUFFER_SIZE_BYTES = 1024 * 1024 * 1024
PACKED_NUM_BUFFERS = 2


class Communicator(Protocol):
    """The part of vLLM's PyNcclCommunicator the trainer uses."""

    def broadcast(self, tensor: Any, src: int, stream: Any = None) -> None: ...

    def destroy(self) -> None: ...


CommunicatorFactory = Callable[..., Communicator]


def rank_offsets(world_sizes: Sequence[int]) -> tuple[list[int], int]:
    """Each server's rank_offset (trainer is rank 0) and the group's world size."""
    if any(size < 1 for size in world_sizes):
        raise ValueError(f"every server needs at least one worker, got {list(world_sizes)}")
    offsets, next_rank = [], 1
    for size in world_sizes:
        offsets.append(next_rank)
        next_rank += size
    return offsets, next_rank


def vllm_trainer_init(init_info: Mapping[str, Any], rank: int = 0) -> Communicator:
    """vLLM's own trainer_init (GPU machines with vLLM 0.33 installed)."""
    from vllm.distributed.weight_transfer.nccl_common import trainer_init

    return trainer_init(dict(init_info), rank=rank)


class GlooCommunicator:
    """A CPU stand-in for PyNcclCommunicator: same constructor inputs, same `broadcast` shape.

    Rank 0 hosts the TCPStore, as in vLLM's StatelessProcessGroup; creating the gloo group
    blocks until every rank has joined (the NCCL group does the same).
    """

    def __init__(
        self, master_address: str, master_port: int, rank: int, world_size: int, timeout_s: float
    ) -> None:
        import torch.distributed as dist

        timeout = datetime.timedelta(seconds=timeout_s)
        self.rank, self.world_size = rank, world_size
        self._store: Any = dist.TCPStore(
            master_address,
            master_port,
            world_size,
            is_master=rank == 0,
            timeout=timeout,
            wait_for_workers=False,
        )
        self._group: Any = dist.ProcessGroupGloo(self._store, rank, world_size, timeout)

    def broadcast(self, tensor: Any, src: int, stream: Any = None) -> None:
        import torch.distributed as dist

        del stream  # gloo moves host memory: no CUDA stream to order against
        # A learner on a GPU sends over gloo through a host copy.
        if self._group is None:
            raise RuntimeError("the gloo group was destroyed")
        host = tensor if tensor.device.type == "cpu" else tensor.cpu()
        options = dist.BroadcastOptions()
        options.rootRank = src
        self._group.broadcast([host], options).wait()
        if host is not tensor:
            tensor.copy_(host)

    def destroy(self) -> None:
        """Close the group's connections, so a peer blocked in a broadcast fails at once.

        The connections close when the group object is freed (shutdown alone keeps them);
        shutting down first keeps gloo from aborting the process when a group whose peer
        died is freed."""
        group, self._group = self._group, None
        if group is not None:
            group.shutdown()
        self._store = None


def gloo_trainer_init(timeout_s: float = 60.0) -> CommunicatorFactory:
    """A trainer_init with vLLM's signature that builds a GlooCommunicator."""

    def init(init_info: Mapping[str, Any], rank: int = 0) -> Communicator:
        return GlooCommunicator(
            init_info["master_address"],
            int(init_info["master_port"]),
            rank,
            int(init_info["world_size"]),
            timeout_s,
        )

    return init


def dtype_name(dtype: Any) -> str:
    """vLLM's dtype_names entry: `getattr(torch, name)` gives the dtype back."""
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class WeightStream:
    """Weights announced up front and produced one at a time, in `names` order."""

    names: tuple[str, ...]  # wire order: the receivers broadcast in this order
    dtype_names: tuple[str, ...]  # torch dtype names ("float32", "bfloat16")
    shapes: tuple[tuple[int, ...], ...]  # the full (unsharded) shape of each tensor
    produce: Callable[[], Iterable[Any]]  # yields the tensors; may run collectives (FSDP)

    @classmethod
    def of(cls, tensors: Mapping[str, Any]) -> WeightStream:
        """A stream over tensors already in memory."""
        return cls(
            tuple(tensors),
            tuple(dtype_name(t.dtype) for t in tensors.values()),
            tuple(tuple(t.shape) for t in tensors.values()),
            lambda: iter(tensors.values()),
        )

    def update_info(self) -> dict[str, Any]:
        """vLLM 0.33's NCCLWeightTransferUpdateInfo fields."""
        return {
            "names": list(self.names),
            "dtype_names": list(self.dtype_names),
            "shapes": [list(s) for s in self.shapes],
        }

    def checked(self) -> Generator[Any]:
        """The produced tensors, each checked against its announced dtype and shape.

        Close it when done (`contextlib.closing`): that closes the producer, even midway."""
        produced = iter(self.produce())
        try:
            yield from self._check(produced)
        finally:
            close = getattr(produced, "close", None)
            if close is not None:
                close()  # a producer in collectives (FSDP) finishes them: no rank is left waiting

    def _check(self, produced: Iterable[Any]) -> Iterable[Any]:
        count = 0
        for tensor in produced:
            if count >= len(self.names):
                raise ValueError(f"the stream produced more than the {len(self.names)} announced")
            name, dtype, shape = self.names[count], self.dtype_names[count], self.shapes[count]
            if dtype_name(tensor.dtype) != dtype or tuple(tensor.shape) != shape:
                raise ValueError(
                    f"tensor {count} ({name!r}) was announced as {dtype} {list(shape)} "
                    f"but is {dtype_name(tensor.dtype)} {list(tensor.shape)}"
                )
            count += 1
            yield tensor
        if count != len(self.names):
            raise ValueError(f"the stream produced {count} of {len(self.names)} announced tensors")


class NcclTransport:
    """Trainer rank 0 of vLLM's NCCL weight transfer (or of its gloo stand-in)."""

    def __init__(
        self,
        master_address: str,
        master_port: int,
        *,
        packed: bool = False,
        trainer_init: CommunicatorFactory = vllm_trainer_init,
    ) -> None:
        self.master_address = master_address
        self.master_port = master_port
        self.packed = packed
        self._trainer_init = trainer_init
        self._group: Communicator | None = None
        self.world_size = 0

    def init_info(self, rank_offset: int, world_size: int) -> dict[str, Any]:
        """The body of one server's /init_weight_transfer_engine (NCCLWeightTransferInitInfo)."""
        info: dict[str, Any] = {
            "master_address": self.master_address,
            "master_port": self.master_port,
            "rank_offset": rank_offset,
            "world_size": world_size,
        }
        if self.packed:
            info |= {
                "packed": True,
                "packed_buffer_size_bytes": PACKED_BUFFER_SIZE_BYTES,
                "packed_num_buffers": PACKED_NUM_BUFFERS,
            }
        return info

    @property
    def ready(self) -> bool:
        """Whether the group is formed (and not closed after a failure)."""
        return self._group is not None

    async def start(self, world_size: int) -> None:
        """Join the group as rank 0; blocks (in a thread) until every worker has joined."""
        self.close()
        self.world_size = world_size
        info = {
            "master_address": self.master_address,
            "master_port": self.master_port,
            "world_size": world_size,
        }
        self._group = await asyncio.to_thread(self._trainer_init, info, 0)

    def update_info(self, stream: WeightStream) -> dict[str, Any]:
        return stream.update_info()

    async def send(self, stream: WeightStream) -> None:
        """Broadcast every tensor from rank 0, in the order of update_info's names.

        On any failure the group is closed (the receivers then fail at once instead of
        waiting out their timeout) and must be formed again with `start`."""
        group = self._group
        if group is None:
            raise RuntimeError("the transfer group is not formed (call start first)")
        try:
            await asyncio.to_thread(self._send, group, stream)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Leave the group, if formed."""
        group, self._group = self._group, None
        if group is not None:
            group.destroy()

    def _send(self, group: Communicator, stream: WeightStream) -> None:
        with contextlib.closing(stream.checked()) as tensors:
            if self.packed:
                from vllm.distributed.weight_transfer.packed_tensor import (
                    packed_nccl_broadcast_producer,
                )

                packed_nccl_broadcast_producer(
                    iterator=zip(stream.names, tensors, strict=True),
                    group=group,
                    src=0,
                    post_iter_func=lambda item: item[1],
                    buffer_size_bytes=PACKED_BUFFER_SIZE_BYTES,
                    num_buffers=PACKED_NUM_BUFFERS,
                )
                return
            cuda_stream = _current_stream()
            for tensor in tensors:
                # NCCL reads numel elements from data_ptr(): a strided view must be contiguous.
                group.broadcast(tensor.contiguous(), src=0, stream=cuda_stream)
            if cuda_stream is not None:
                cuda_stream.synchronize()  # the caller may change the weights once send returns


def _current_stream() -> Any:
    import torch

    return torch.cuda.current_stream() if torch.cuda.is_available() else None
