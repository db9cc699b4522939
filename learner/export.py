"""Hugging Face weights out of a (possibly sharded) model, one full tensor at a time.

`write_safetensors(lm, path, writer)` is collective under FSDP: every rank walks the
model's state dict in the same order and gathers one full tensor at a time
(`DTensor.full_tensor`); only the ``writer`` rank writes it and drops it before the next.
The safetensors header is computed up front from the global shapes, so the file is written
incrementally and the extra memory on the writing rank is bounded by the largest single
tensor, not by the model. Tied weights are written once, under their first name (as
``save_pretrained`` does). `export_hf_dir` adds the model config and tokenizer files, so the
directory is what vLLM and the CPU server load.
"""

from __future__ import annotations

import json
import shutil
import struct
from collections.abc import Iterator
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor

WEIGHTS = "model.safetensors"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja", "vocab.json", "merges.txt")  # fmt: skip
_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16",
           torch.int64: "I64", torch.int32: "I32", torch.uint8: "U8", torch.bool: "BOOL"}  # fmt: skip


def _unique_entries(lm: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    seen: set[int] = set()
    for name, tensor in lm.state_dict(keep_vars=True).items():
        if id(tensor) in seen:  # a tied weight: already written under its first name
            continue
        seen.add(id(tensor))
        yield name, tensor


def _header(entries: list[tuple[str, torch.Tensor]]) -> bytes:
    meta: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, t in entries:
        size = t.numel() * t.element_size()
        meta[name] = {"dtype": _DTYPES[t.dtype], "shape": list(t.shape),
                      "data_offsets": [offset, offset + size]}  # fmt: skip
        offset += size
    raw = json.dumps(meta, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data section starts 8-byte aligned
    return struct.pack("<Q", len(raw)) + raw


def write_safetensors(lm: torch.nn.Module, path: Path, writer: bool) -> int:
    """Stream `lm`'s full weights into `path` (on the writer rank); returns the largest
    tensor gathered, in bytes (the bound on the extra memory)."""
    entries = list(_unique_entries(lm))
    largest = 0
    out = open(path, "wb") if writer else None
    try:
        if out is not None:
            out.write(_header(entries))
        for _, tensor in entries:
            full = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
            full = full.detach().to("cpu").contiguous()
            largest = max(largest, full.numel() * full.element_size())
            if out is not None:
                out.write(full.reshape(-1).view(torch.uint8).numpy().data)  # no byte copy
            del full
    finally:
        if out is not None:
            out.close()
    return largest


def export_hf_dir(
    lm: torch.nn.Module, out_dir: Path, writer: bool, tokenizer_dir: Path | None = None
) -> int:
    """A servable Hugging Face directory: weights, config (and tokenizer files)."""
    if writer:
        out_dir.mkdir(parents=True, exist_ok=True)
    largest = write_safetensors(lm, out_dir / WEIGHTS, writer)
    if writer:
        lm.config.save_pretrained(out_dir)  # type: ignore[union-attr, operator]
        generation = getattr(lm, "generation_config", None)
        if generation is not None:
            generation.save_pretrained(out_dir)
        for name in TOKENIZER_FILES:
            if tokenizer_dir is not None and (tokenizer_dir / name).is_file():
                shutil.copy2(tokenizer_dir / name, out_dir / name)
    return largest
