"""The process group under torchrun: batch broadcast, control commands, stat reductions.

Rank 0 is the only rank that talks to Redis, the task source, the inference
servers and the checkpoint directory. Each step it broadcasts the batch's
groups (msgpack through `broker.codec`, never pickle); every rank plans the same
micro-batches from them and trains its share (`learner.trainer`), FSDP2 summing
the gradients (`learner.sharding`). Collective work that rank 0 decides on
(save a checkpoint, export weights for a push) is announced with `broadcast_command`
so the other ranks join it. Gloo on CPU, NCCL on CUDA; one process without
torchrun is the world of size one and does nothing here.

`close()` ends the group for good while the interpreter is whole. `destroy_process_group`
alone does not end the group under FSDP2: the device mesh holds it (`DeviceMesh._pg_registry`),
and DTensor's caches (sharding propagation, in Python and in C++; redistribution plans) hold the
mesh for the life of the process. The group's threads (gloo's event loop, two work threads) then
ran on until interpreter teardown destroyed the group (`~ProcessGroupGloo` under
`Py_FinalizeEx`'s module cleanup), while the other rank was exiting too; that is the window
in which, with the CPU busy, a rank died after `done` with "terminate called without an active
exception" (SIGABRT). So the one data-parallel mesh is made here (`device_mesh`), and `close()`
takes the group out of it: the group and its threads end inside `close()`.
"""

from __future__ import annotations

import gc
import logging
import os
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack
import torch
import torch.distributed as dist

from broker.codec import decode, encode
from broker.messages import TrajectoryGroup

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DistContext:
    """This process's place in the world."""

    rank: int = 0
    world: int = 1
    local_rank: int = 0
    _meshes: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def enabled(self) -> bool:
        return self.world > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def shard(self, items: Sequence) -> list:
        """This rank's share of `items` (the replicated critic trains on it)."""
        return list(items[self.rank :: self.world])

    def all_reduce_grads(self, model: torch.nn.Module) -> None:
        """Sum the gradients of a replicated (unsharded) module across ranks: the critic's.
        The policy is FSDP-sharded, and FSDP reduces its gradients itself."""
        if not self.enabled:
            return
        for p in model.parameters():
            if not p.requires_grad:
                continue
            if p.grad is None:  # this rank had no sequence: it still takes part in the sum
                p.grad = torch.zeros_like(p)
            dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)

    def reduce_sums(self, values: torch.Tensor) -> torch.Tensor:
        """Each entry summed across ranks."""
        return self._reduce(values, dist.ReduceOp.SUM)

    def reduce_mins(self, values: torch.Tensor) -> torch.Tensor:
        """Each entry's minimum across ranks."""
        return self._reduce(values, dist.ReduceOp.MIN)

    def _reduce(self, values: torch.Tensor, op: dist.ReduceOp) -> torch.Tensor:
        if not self.enabled:
            return values
        out = values.clone()
        dist.all_reduce(out, op=op)
        return out

    def broadcast_command(self, command: str | None, arg: str = "") -> tuple[str, str]:
        """Rank 0's (command, argument) on every rank (other ranks pass None)."""
        if not self.enabled:
            return command or "", arg
        payload = msgpack.packb([command, arg]) if self.is_main else b""
        got = msgpack.unpackb(self._broadcast_bytes(payload), raw=False)
        return str(got[0]), str(got[1])

    def broadcast_groups(self, groups: Sequence[TrajectoryGroup] | None) -> list[TrajectoryGroup]:
        """Rank 0's groups on every rank; an empty list means stop."""
        if not self.enabled:
            return list(groups or [])
        payload = b""
        if self.is_main:
            payload = msgpack.packb([encode(g) for g in groups or []], use_bin_type=True)
        data = self._broadcast_bytes(payload)
        out: list[TrajectoryGroup] = []
        for fields in msgpack.unpackb(data, raw=False, strict_map_key=False):
            message = decode(
                {k.encode() if isinstance(k, str) else k: v for k, v in fields.items()}
            )
            assert isinstance(message, TrajectoryGroup)
            out.append(message)
        return out

    def _broadcast_bytes(self, payload: bytes) -> bytes:
        size = torch.tensor([len(payload)], dtype=torch.long)
        dist.broadcast(size, src=0)
        buf = torch.zeros(int(size.item()), dtype=torch.uint8)
        if self.is_main and len(payload):
            buf = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        if int(size.item()):
            dist.broadcast(buf, src=0)
        return buf.numpy().tobytes()

    def barrier(self) -> None:
        if self.enabled:
            dist.barrier()

    def device_mesh(self, device_type: str) -> Any:
        """The 1-D data-parallel `DeviceMesh` over every rank (made once per device type)."""
        from torch.distributed.device_mesh import init_device_mesh

        if device_type not in self._meshes:
            self._meshes[device_type] = init_device_mesh(device_type, (self.world,))
        return self._meshes[device_type]

    def close(self) -> None:
        """Destroy the process group, and see that it is gone (its threads joined).

        Call it once whatever used the group (the model, its FSDP state) is out of scope."""
        if not (self.enabled and dist.is_initialized()):
            return
        world = weakref.ref(dist.group.WORLD)
        gc.collect()  # the FSDP-wrapped model's reference cycles hold the group too
        dist.destroy_process_group()
        for mesh in self._meshes.values():
            # torch 2.13: the registry is shared by the mesh and its submeshes, and DTensor's
            # caches keep the mesh; it is never used again after the group is gone
            mesh._pg_registry.clear()
        self._meshes.clear()
        if world() is not None:
            log.warning(
                "the process group outlived destroy_process_group: something still holds it, "
                "so it ends with the interpreter"
            )


def init_distributed(device: torch.device) -> DistContext:
    """Join torchrun's process group when WORLD_SIZE > 1."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return DistContext()
    rank = int(os.environ["RANK"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    backend = "gloo"
    if device.type == "cuda":  # NCCL for the model; gloo for the small host-side broadcasts
        torch.cuda.set_device(device)
        backend = "cpu:gloo,cuda:nccl"
    dist.init_process_group(backend=backend)
    return DistContext(rank=rank, world=world, local_rank=local_rank)
