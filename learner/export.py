"""Hugging Face weights out of a (possibly sharded) model, streamed in bounded buckets.

`write_safetensors(lm, path, writer)` is collective under FSDP: every rank walks the
model's state dict in the same order. The safetensors header is computed up front from the
global shapes, then each tensor's bytes are written in order. An FSDP parameter is a
``Shard(0)`` DTensor: its full bytes are rank 0's rows, then rank 1's, and so on, so each
rank's rows are broadcast in buckets of at most ``bucket_bytes`` and the writer appends
them as they arrive. The extra memory on any rank is one bucket, not a tensor and not the
model. Tied weights are written once, under their first name (as ``save_pretrained``
does). `export_hf_dir` adds the model config and tokenizer files, so the directory is what
vLLM and the CPU server load.

`full_weights(lm, main)` is the same walk for a weight transfer (vLLM's NCCL routes): each
tensor is gathered whole on the main rank (the extra memory is the largest tensor) and
yielded in the order `weight_metadata(lm)` announces, from the global shapes, before any
gather. Every rank must run it to the end; stopped early, it finishes the gathers itself.
"""

from __future__ import annotations

import json
import math
import shutil
import struct
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard

WEIGHTS = "model.safetensors"
BUCKET_BYTES = 64 * 2**20  # the most any rank holds at once while streaming
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "vocab.json",
    "merges.txt",
)
_DTYPES = {
    torch.float32: "F32",
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


Weights = Mapping[str, torch.Tensor]  # name -> tensor, in file order (a model's state dict)


def _unique_entries(
    lm: torch.nn.Module, weights: Weights | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    seen: set[int] = set()
    for name, tensor in (weights if weights is not None else lm.state_dict(keep_vars=True)).items():
        if id(tensor) in seen:  # a tied weight: already written under its first name
            continue
        seen.add(id(tensor))
        yield name, tensor


def _header(entries: list[tuple[str, torch.Tensor]]) -> bytes:
    meta: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, t in entries:
        size = t.numel() * t.element_size()
        meta[name] = {
            "dtype": _DTYPES[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    raw = json.dumps(meta, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data section starts 8-byte aligned
    return struct.pack("<Q", len(raw)) + raw


def _row_buckets(tensor: DTensor, bucket_bytes: int) -> Iterator[tuple[int, int, int]]:
    """(source rank, first row, end row) in the source's local rows, in file order."""
    rows, world = tensor.shape[0], tensor.device_mesh.size()
    per_rank = -(-rows // world)  # torch.chunk's split, which FSDP uses
    # from the shape: indexing the DTensor (tensor[0]) would all-gather all of it
    row_bytes = max(1, math.prod(tensor.shape[1:]) * tensor.element_size())
    step = max(1, bucket_bytes // row_bytes)
    for rank in range(world):
        held = max(0, min(rows, (rank + 1) * per_rank) - rank * per_rank)
        for start in range(0, held, step):
            yield rank, start, min(held, start + step)


def _stream_sharded(
    tensor: DTensor, sink: Callable[[torch.Tensor], None] | None, bucket_bytes: int
) -> int:
    """Broadcast each rank's rows bucket by bucket; `sink` (on the receiving rank) takes them
    in order. Returns the largest bucket in bytes."""
    local = tensor.to_local().detach()
    me = tensor.device_mesh.get_local_rank()
    largest = 0
    for src, start, stop in _row_buckets(tensor, bucket_bytes):
        shape = (stop - start, *tensor.shape[1:])
        if me == src:
            bucket = local[start:stop].contiguous()
        else:
            bucket = torch.empty(shape, dtype=local.dtype, device=local.device)
        dist.broadcast(bucket, group=tensor.device_mesh.get_group(), group_src=src)
        largest = max(largest, bucket.numel() * bucket.element_size())
        if sink is not None:
            sink(bucket)
        del bucket
    return largest


def _is_row_sharded(tensor: torch.Tensor) -> bool:
    return (
        isinstance(tensor, DTensor)
        and tensor.ndim > 0
        and tensor.device_mesh.ndim == 1
        and tensor.placements == (Shard(0),)
    )


def write_safetensors(
    lm: torch.nn.Module,
    path: Path,
    writer: bool,
    bucket_bytes: int = BUCKET_BYTES,
    weights: Weights | None = None,
) -> int:
    """Stream `lm`'s full weights (or `weights`, e.g. LoRA merged in) into `path` (on the
    writer rank); returns the largest buffer any step held, in bytes (the bound on the
    extra memory)."""
    entries = list(_unique_entries(lm, weights))
    largest = 0
    out = open(path, "wb") if writer else None
    sink = None if out is None else lambda b: out.write(_raw(b))
    try:
        if out is not None:
            out.write(_header(entries))
        for _, tensor in entries:
            if _is_row_sharded(tensor):
                largest = max(largest, _stream_sharded(tensor, sink, bucket_bytes))  # type: ignore[arg-type]
                continue
            full = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
            full = full.detach().to("cpu").contiguous()
            largest = max(largest, full.numel() * full.element_size())
            if out is not None:
                out.write(_raw(full))
            del full
    finally:
        if out is not None:
            out.close()
    return largest


def _raw(tensor: torch.Tensor) -> memoryview:
    return tensor.cpu().reshape(-1).view(torch.uint8).numpy().data  # no byte copy


def weight_metadata(lm: torch.nn.Module) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    """(name, dtype, global shape) of every weight `full_weights` yields, in its order;
    read from the (sharded) parameters without gathering."""
    return [(name, t.dtype, tuple(t.shape)) for name, t in _unique_entries(lm)]


def full_weights(
    lm: torch.nn.Module, main: bool, bucket_bytes: int = BUCKET_BYTES
) -> Iterator[torch.Tensor | None]:
    """Each weight gathered whole, on the model's device, on `main` (None elsewhere).

    Collective under FSDP: every rank iterates it to the end (closing it early finishes the
    remaining gathers without yielding), so a transfer that fails halfway leaves no rank
    waiting in a gather."""
    gathered = (_gathered(t, main, bucket_bytes) for _, t in _unique_entries(lm))
    try:
        # not `yield from`: it would close `gathered` on GeneratorExit and skip the drain
        for tensor in gathered:  # noqa: UP028
            yield tensor
    finally:
        for _ in gathered:  # the other ranks are still in these gathers
            pass


def _gathered(tensor: torch.Tensor, main: bool, bucket_bytes: int) -> torch.Tensor | None:
    if not _is_row_sharded(tensor):
        full = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
        return full.detach() if main else None
    local = tensor.to_local()  # type: ignore[attr-defined]
    out = torch.empty(tensor.shape, dtype=local.dtype, device=local.device) if main else None
    filled = 0

    def put(bucket: torch.Tensor) -> None:
        nonlocal filled
        out[filled : filled + bucket.shape[0]].copy_(bucket)  # type: ignore[index]
        filled += bucket.shape[0]

    _stream_sharded(tensor, put if main else None, bucket_bytes)  # type: ignore[arg-type]
    return out


def export_hf_dir(
    lm: torch.nn.Module,
    out_dir: Path,
    writer: bool,
    tokenizer_dir: Path | None = None,
    weights: Weights | None = None,
) -> int:
    """A servable Hugging Face directory: weights (`lm`'s, or `weights`), config (and
    tokenizer files)."""
    if writer:
        out_dir.mkdir(parents=True, exist_ok=True)
    largest = write_safetensors(lm, out_dir / WEIGHTS, writer, weights=weights)
    if writer:
        lm.config.save_pretrained(out_dir)  # type: ignore[union-attr, operator]
        generation = getattr(lm, "generation_config", None)
        if generation is not None:
            generation.save_pretrained(out_dir)
        for name in TOKENIZER_FILES:
            if tokenizer_dir is not None and (tokenizer_dir / name).is_file():
                shutil.copy2(tokenizer_dir / name, out_dir / name)
    return largest
