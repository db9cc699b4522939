"""FSDP2 (`torch.distributed.fsdp.fully_shard`) over the policy: one call, CPU or CUDA alike.

`shard_policy` shards every decoder layer as its own FSDP unit, then the `PolicyModel`
root (embeddings, final norm, LM head). Parameters, gradients and AdamW state then live
as ``Shard(0)`` DTensors, 1/world of each per rank. Options: bf16 parameters and compute
with fp32 gradient reduction (`MixedPrecisionPolicy`, CUDA), CPU offload of parameters,
gradients and optimizer state (`CPUOffloadPolicy`), activation checkpointing of the layers.

Gradients are *summed* across ranks, not averaged: every loss share is already divided by
whole-batch denominators (`learner.algorithms.aggregate`), so the sum is the single-process
gradient. Gloo and NCCL differ only in the device mesh's device type. The mesh is the
process group's (`learner.distributed.DistContext.device_mesh`), which releases it at the end.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)
from torch.distributed.tensor import DTensor

from learner.policy import PolicyModel


@dataclass(frozen=True)
class ShardOptions:
    """How the policy is sharded (from the config's scale block)."""

    bf16: bool  # bf16 params/compute, fp32 reduction (CUDA only)
    cpu_offload: bool  # parameters, gradients and optimizer state on the host


def shard_policy(policy: PolicyModel, mesh: DeviceMesh, opts: ShardOptions) -> None:
    """Apply FSDP2 in place over the data-parallel `mesh`, layers first, then the root."""
    cuda = mesh.device_type == "cuda"
    mp = MixedPrecisionPolicy()
    if opts.bf16 and cuda:
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    offload = OffloadPolicy()
    if opts.cpu_offload:
        offload = CPUOffloadPolicy(pin_memory=cuda)
    for layer in policy.layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp, offload_policy=offload)
    fully_shard(policy, mesh=mesh, mp_policy=mp, offload_policy=offload)
    for module in policy.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)  # sum: the losses carry the denominators
            module.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM


def clip_grad_norm(params: list[torch.nn.Parameter], max_norm: float) -> float:
    """Global-norm clipping over (possibly sharded) gradients; returns the norm before clipping."""
    grads = [p.grad for p in params if p.grad is not None]
    norm = torch.nn.utils.get_total_norm(grads)
    if isinstance(norm, DTensor):  # partial per-shard norms: reduce to the global one
        norm = norm.full_tensor()
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
    return float(norm)
