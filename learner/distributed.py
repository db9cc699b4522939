"""Data parallelism under torchrun: process group, batch broadcast, gradient sums.

Rank 0 is the only rank that talks to Redis, the task source, the inference
servers and the checkpoint directory. Each step it broadcasts the batch's
groups (msgpack through `broker.codec`, never pickle) and every rank trains a
disjoint slice of the batch's sequences (``samples[rank::world]``). Losses are
normalised by whole-batch denominators, so summing gradients across ranks gives
the single-process gradient up to floating-point rounding. Gloo on CPU, NCCL on
CUDA; one process without torchrun is the world of size one and does nothing.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

import msgpack
import torch
import torch.distributed as dist

from broker.codec import decode, encode
from broker.messages import TrajectoryGroup


@dataclass(frozen=True)
class DistContext:
    """This process's place in the world."""

    rank: int = 0
    world: int = 1
    local_rank: int = 0

    @property
    def enabled(self) -> bool:
        return self.world > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def shard(self, items: Sequence) -> list:
        return list(items[self.rank :: self.world])

    def all_reduce_grads(self, model: torch.nn.Module) -> None:
        if not self.enabled:
            return
        for p in model.parameters():
            if not p.requires_grad:
                continue
            if p.grad is None:  # this rank had no sequence: it still takes part in the sum
                p.grad = torch.zeros_like(p)
            dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)

    def reduce_stats(self, sums: torch.Tensor) -> torch.Tensor:
        """Sum entries 0..3 and take the minimum of entries 4.. across ranks."""
        if not self.enabled:
            return sums
        head, tail = sums[:4].clone(), sums[4:].clone()
        dist.all_reduce(head, op=dist.ReduceOp.SUM)
        dist.all_reduce(tail, op=dist.ReduceOp.MIN)
        return torch.cat([head, tail])

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

    def broadcast_model(self, model: torch.nn.Module) -> None:
        """Start every rank from rank 0's weights (resume loads them on rank 0 only)."""
        if not self.enabled:
            return
        for tensor in model.state_dict().values():
            dist.broadcast(tensor, src=0)

    def barrier(self) -> None:
        if self.enabled:
            dist.barrier()

    def close(self) -> None:
        if self.enabled and dist.is_initialized():
            dist.destroy_process_group()


def init_distributed(device: torch.device) -> DistContext:
    """Join torchrun's process group when WORLD_SIZE > 1."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return DistContext()
    rank = int(os.environ["RANK"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend=backend)
    return DistContext(rank=rank, world=world, local_rank=local_rank)
