"""vLLM 0.33's GPU sampling steps, run by vLLM's own Triton kernels: the reference for the tie rule.

On CUDA vLLM 0.33 runs Model Runner V2 by default (``vllm/config/vllm.py:731-767``: on unless
``VLLM_USE_V2_MODEL_RUNNER=0``, Triton is missing or a listed feature needs V1). Its sampler
(``vllm/v1/worker/gpu/sample/sampler.py:226-360``) processes the logits of a
``processed_logprobs`` request in this order, and `processed` does the same:

1. a float32 copy, then the allowed-token mask (``LogitBiasState``, the first logits
   processor; its kernel writes -inf everywhere and restores the allowed ids,
   ``logit_bias.py:191-222``; done here with ``masked_fill``);
2. the temperature (``gumbel.py`` ``_temperature_kernel``: a row at 0 or 1 is left as is);
3. min-p (``min_p.py`` ``_min_p_kernel``: ``z < max z + log(min_p)`` becomes -inf);
4. top-k/top-p: ``apply_top_k_top_p`` (``ops/topk_topp_sampler.py:501-521``), which with Triton
   present (always, on CUDA) calls ``apply_top_k_top_p_triton`` (``ops/topk_topp_triton.py``).
   That dispatches by batch: with top-p on and at most 64 rows, rows without an active top-k
   go through the split pipeline (``_apply_topp_split``) and the rest through the monolithic
   ``_topk_topp_kernel``; above 64 rows every row goes through the monolithic kernel.
   FlashInfer's sampler is never used for ``processed_logprobs`` (``sampler.py:307-315``).

On a CUDA tensor the real ``apply_top_k_top_p`` dispatches. On a CPU tensor (Triton's
interpreter, ``TRITON_INTERPRET=1``) that function would pick CPU tile sizes and skip the split
pipeline (it tests ``logits.device.type == "cuda"``), so `processed` launches the same kernels
with the CUDA launch parameters of ``_topk_topp`` (``topk_topp_triton.py:936-961``) and the
CUDA branch of ``apply_top_k_top_p_triton`` (lines 1674-1727), for the batch size it is told.

It imports vLLM lazily: the contract environment (tests/inference/vllm_contract/env.py) or the
bundle of vLLM's kernel files that scripts/gpu_sampler_check.sh carries to a GPU machine.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Literal

import torch

Batch = Literal["small", "large"]  # <= 64 rows (the split top-p pipeline), > 64 (monolithic)
H100_SMS = 132  # streaming multiprocessors of an H100 SXM: the split pipeline sizes by them


@dataclass(frozen=True)
class Row:
    """One request's sampling parameters as vLLM's ``SamplingParams`` leaves them."""

    temperature: float  # 0 (greedy) or in [0.01, 2]
    top_k: int  # 0 or >= vocab: off
    top_p: float  # 1: off
    min_p: float  # 0: off
    allowed: tuple[int, ...] | None = None  # None: every token


def processed(
    logits: torch.Tensor, rows: list[Row], batch: Batch = "small", num_sm: int = H100_SMS
) -> torch.Tensor:
    """vLLM's processed logits of `logits` ([N, V], any float dtype): -inf outside the kept set.
    `batch` and `num_sm` choose the CUDA dispatch emulated on a CPU tensor (ignored on CUDA,
    where vLLM's own dispatch sees the real batch size and device)."""
    from vllm.v1.worker.gpu.sample.gumbel import apply_temperature
    from vllm.v1.worker.gpu.sample.min_p import apply_min_p

    n, vocab = logits.shape
    z = torch.empty_like(logits, dtype=torch.float32).copy_(logits)
    for i, row in enumerate(rows):
        if row.allowed is not None:
            keep = torch.zeros(vocab, dtype=torch.bool, device=z.device)
            keep[list(row.allowed)] = True
            z[i].masked_fill_(~keep, float("-inf"))
    index = torch.arange(n, dtype=torch.int32, device=z.device)
    temperature = torch.tensor([r.temperature for r in rows], device=z.device)
    if not all(r.temperature in (0.0, 1.0) for r in rows):  # states.py:87-92
        apply_temperature(z, index, temperature)
    if any(r.min_p for r in rows):  # states.py:100-103
        apply_min_p(z, index, torch.tensor([r.min_p for r in rows], device=z.device))
    # states.py:49-51, 105-121: an off top-k is the vocabulary size
    k = [r.top_k if 0 < r.top_k < vocab else vocab for r in rows]
    top_k = torch.tensor(k, dtype=torch.int32, device=z.device) if min(k) < vocab else None
    p = [r.top_p for r in rows]
    top_p = torch.tensor(p, device=z.device) if min(p) < 1.0 else None
    p_only = top_p is not None and any(a >= vocab and b < 1.0 for a, b in zip(k, p, strict=True))
    if top_k is None and top_p is None:
        return z
    if z.device.type == "cuda":
        from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p

        return apply_top_k_top_p(z, top_k, top_p, has_topp_only_rows=p_only)
    return _cuda_dispatch_on_cpu(z, top_k, top_p, p_only, small=batch == "small", num_sm=num_sm)


def _cuda_dispatch_on_cpu(
    z: torch.Tensor,
    top_k: torch.Tensor | None,
    top_p: torch.Tensor | None,
    p_only: bool,
    *,
    small: bool,
    num_sm: int,
) -> torch.Tensor:
    """``apply_top_k_top_p_triton``'s CUDA branch, launched on a CPU tensor."""
    from vllm.v1.sample.ops import topk_topp_triton as kernels

    n, vocab = z.shape
    neg_inf = float("-inf")
    split = top_p is not None and small
    if split and top_k is None:
        kernels._apply_topp_split(z, None, top_p, neg_inf, num_sm)
        return z
    programs = min(num_sm, n)
    kernels._topk_topp_kernel[(programs,)](
        LOGITS=z,
        LOGITS_STRIDE_0=z.stride(0),
        BUFFER=z.new_empty((programs, vocab)),
        PERCENTILE_TO_STD_TABLE=z.new_tensor(kernels._PERCENTILE_TO_STD_TABLE),
        NORMAL_CDF_TO_SIGMA_TABLE=z.new_tensor(kernels._NORMAL_CDF_TO_SIGMA_TABLE),
        K=z if top_k is None else top_k,
        P=z if top_p is None else top_p,
        BATCH_SIZE=n,
        VOCAB_SIZE=vocab,
        MASK_VALUE=neg_inf,
        BLOCK_SIZE=8192,
        BLOCK_SIZE_TRUNC=4096,
        TOPK_ENABLED=top_k is not None,
        TOPP_ENABLED=top_p is not None,
        SPLIT_COVERS_PONLY=split,
        num_warps=8,
    )
    if split and p_only:
        kernels._apply_topp_split(z, top_k, top_p, neg_inf, num_sm)
    return z


def patch_triton_interpreter() -> None:
    """Make ``tl.range`` yield tensors under ``TRITON_INTERPRET=1``, as compiled code does.

    Triton's interpreter (3.6 to 3.8) maps ``tl.range`` to Python's ``range``, so a loop index is
    an ``int``; vLLM's monolithic kernel calls ``row_id.to(tl.int64)`` on its row loop index
    (``topk_topp_triton.py:127-128``), which an ``int`` lacks. Wrapping each index as an int32
    scalar tensor changes nothing else: a compiled loop index is exactly that. Triton 3.6's
    interpreter also needs 3.8's ``tensor.__index__`` to run under NumPy 2.
    """
    import numpy as np
    import triton.language as tl
    import triton.runtime.interpreter as interpreter

    patch_core = interpreter._patch_lang_core
    if getattr(patch_core, "_farm_tensor_range", False):
        return

    def patched(lang, scope) -> None:  # type: ignore[no-untyped-def]
        patch_core(lang, scope)

        def tensor_range(arg1, arg2=None, step=None, **_):  # type: ignore[no-untyped-def]
            start, end = (0, arg1) if arg2 is None else (arg1, arg2)
            step = 1 if step is None else step
            for i in range(_int(start), _int(end), _int(step)):
                handle = interpreter.TensorHandle(np.array([i], dtype=np.int32), tl.int32)
                yield tl.tensor(handle, tl.int32)

        scope.set_attr(lang, "range", tensor_range)
        # 3.8's own `__index__` (3.6's calls int() on a one-element array: NumPy 2 refuses)
        scope.set_attr(lang.tensor, "__index__", _int)

    def _int(value) -> int:  # type: ignore[no-untyped-def]
        # an interpreter scalar holds a one-element array (3.6's `__index__` rejects it)
        handle = getattr(value, "handle", None)
        return operator.index(value) if handle is None else int(handle.data.reshape(-1)[0])

    patched._farm_tensor_range = True  # type: ignore[attr-defined]
    interpreter._patch_lang_core = patched
