"""The CPU policy engine: a continuous-batching loop over a transformers causal LM.

Requests queue in `waiting`; each loop turn admits what fits into the running batch (after a
short collection window when the engine was idle), then runs one forward pass for the
sequences that need a prefill and one for those decoding, so concurrent requests share
forward passes. A prefill left-pads the new sequences' own KV into one `DynamicCache`, with an
attention mask and explicit position ids; decoding sequences keep their KV as rows of a
persistent `DecodeBatch` (`inference.decode_batch`) that they join after their prefill and
leave when they finish. Sequences of any length batch together and each row computes what a
lone forward pass would. A new sequence
first takes the KV of its prompt's longest cached prefix from the `PrefixCache` and prefills
only the rest; prefilled and finished sequences give their full blocks back to the cache, which
is cleared whenever the weights change. With LoRA enabled (`inference.lora`), a step runs one
forward pass per adapter among its sequences, with that adapter's hooks active; prefix-cache keys
are salted per adapter load, and at most `max_loras` adapters are in the running batch at once
(a request of a further one waits, as in vLLM). Forward passes run
in a worker thread under `_lock`, which is also what pause and weight reload take, so weights
never change in the middle of a step. Invariants: every submitted request's future resolves
exactly once (tokens, an abort, or an error); tokens carry the weight version that sampled them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from pathlib import Path
from typing import Literal

import torch
from transformers import DynamicCache

from inference import metrics
from inference.decode_batch import DecodeBatch, cache_kwarg, supports_batching
from inference.errors import EngineError
from inference.lora import AdapterTable, LoraAdapter
from inference.prefix_cache import PrefixCache
from inference.sampling import sample_rows
from inference.sequence import GenRequest, Sequence
from inference.weight_files import copy_weights, read_weights

log = logging.getLogger(__name__)

PauseMode = Literal["abort", "wait", "keep"]


def version_number(label: str) -> int:
    """The gauge value of a version label: the integer, or -1 for a non-integer label."""
    try:
        return int(label)
    except ValueError:
        return -1


class Engine:
    """Owns the model; `run()` is the batching loop; pause/resume/reload are safe between steps."""

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        eos_ids: frozenset[int],
        pad_id: int,
        max_model_len: int,
        max_batch: int,
        batch_window_s: float,
        version: str,
        prefix_cache: PrefixCache | None = None,
        lora: AdapterTable | None = None,
    ) -> None:
        self.model = model.eval()
        self.lora = lora  # None: LoRA not enabled
        self._cache_arg = cache_kwarg(model)
        self.prefix_cache = prefix_cache or PrefixCache(0)
        self.eos_ids = eos_ids
        self.pad_id = pad_id
        self.max_model_len = max_model_len
        self.max_batch = max_batch
        self.batch_window_s = batch_window_s
        self.version = version
        self.paused = False
        self._holding = False  # new requests are held (a pause was asked for)
        self.rejecting = False  # new requests are refused (503): an abort or wait pause, as vLLM
        self._waiting: deque[GenRequest] = deque()
        self._held: deque[GenRequest] = deque()
        self._running: list[GenRequest] = []
        # decoding sequences' KV, per adapter load (0: none); None: the model's cache layers
        # are not all full attention, so every step pads a fresh cache
        self._batches: dict[int, DecodeBatch] | None = {} if supports_batching(model) else None
        self._lock = asyncio.Lock()
        self._wake = asyncio.Event()
        self._drained = asyncio.Event()
        metrics.WEIGHT_VERSION.set(version_number(version))
        metrics.PAUSED.set(0)

    # --- requests --------------------------------------------------------------------------
    def submit(self, request: GenRequest) -> None:
        """Queue `request`; EngineError 503 during an abort or wait pause (vLLM 0.33's answer)."""
        if self.rejecting:
            raise EngineError("Generation is paused. Please retry after it resumes.", status=503)
        (self._held if self._holding else self._waiting).append(request)
        self._wake.set()
        self._update_gauges()

    def abort(self, request: GenRequest) -> None:
        """Finish every unfinished sequence of `request` with reason `abort`; resolve it."""
        for seq in request.seqs:
            if seq.finish_reason is None:
                seq.finish_reason = "abort"
        for queue in (self._waiting, self._held):
            if request in queue:
                queue.remove(request)
        request.resolve()
        self._update_gauges()

    # --- control ---------------------------------------------------------------------------
    async def pause(self, mode: PauseMode, clear_cache: bool = True) -> None:
        """Stop generating. abort: end in-flight requests now; wait: let them finish; keep: freeze them.

        As in vLLM 0.33: abort and wait refuse new requests until resume (`rejecting`), keep
        queues them; `clear_cache` drops the KV of frozen sequences, which then recompute
        their prompt and generated tokens with the weights loaded at resume.
        """
        self._holding = True
        self.rejecting = mode != "keep"
        if mode == "wait":
            self.paused = False  # requests frozen by an earlier keep must run to completion too
            self._drained.clear()
            if self._waiting or self._running:
                self._wake.set()
                await self._drained.wait()
        async with self._lock:  # no forward pass is in flight past this point
            self.paused = True
            if mode == "abort":
                for request in [*self._running, *self._waiting]:
                    self.abort(request)
                self._running.clear()
            if clear_cache:
                self._drop_caches()
        metrics.PAUSED.set(1)
        self._update_gauges()

    def _drop_caches(self) -> None:
        self.prefix_cache.clear()
        for request in self._running:
            for seq in request.seqs:
                if seq.finish_reason is None and seq.holds_kv:
                    seq.drop_kv()  # the next step re-prefills everything seen so far
                    seq.pending = [*seq.prompt, *seq.tokens]
        self._release_batches()

    def _release_batches(self) -> None:
        """Every decode batch lets its rows go (their KV dropped) and frees its buffers."""
        for batch in (self._batches or {}).values():
            batch.sync([])

    def resume(self) -> None:
        self.paused = False
        self._holding = False
        self.rejecting = False
        self._waiting.extend(self._held)
        self._held.clear()
        self._wake.set()
        metrics.PAUSED.set(0)
        self._update_gauges()

    def set_version(self, label: str) -> None:
        self.version = label
        metrics.WEIGHT_VERSION.set(version_number(label))

    async def reload_weights(self, path: Path) -> None:
        """Load safetensors weights from `path` (file or HF directory); all-or-nothing."""
        started = time.perf_counter()
        tensors = await asyncio.to_thread(read_weights, path)
        await self.load_weights(tensors)
        metrics.RELOAD_SECONDS.observe(time.perf_counter() - started)

    async def load_weights(self, tensors: dict[str, torch.Tensor], complete: bool = True) -> None:
        """Copy `tensors` into the model between steps; all-or-nothing. `complete`: every
        weight must be given (a file reload); a transfer may send a subset, as vLLM's may."""
        async with self._lock:
            await asyncio.to_thread(copy_weights, self.model, tensors, complete)
            self.prefix_cache.clear()  # its KV came from the old weights

    async def add_adapter(self, adapter: LoraAdapter) -> None:
        """Serve a LoRA adapter under its name; between steps (its hooks go on the model)."""
        if self.lora is None:
            raise EngineError("LoRA is not enabled on this server (start it with enable_lora)")
        async with self._lock:
            self.lora.add(adapter)

    async def reset_prefix_cache(self) -> None:
        """Drop every cached block; between steps, so no forward pass is using the cache."""
        async with self._lock:
            self.prefix_cache.clear()

    # --- the loop --------------------------------------------------------------------------
    async def run(self) -> None:
        """The batching loop; runs until cancelled."""
        while True:
            await self._wake.wait()
            if not self._running and self._waiting and self.batch_window_s > 0:
                await asyncio.sleep(self.batch_window_s)  # let concurrent requests arrive together
            async with self._lock:
                if not self.paused:
                    self._admit()
                    if self._running:
                        await self._step()
            try:
                self._after_step()
            # failed bookkeeping fails the running requests, never the loop
            except Exception as exc:
                log.exception("engine bookkeeping after a step failed")
                self._fail_running(EngineError(f"generation failed: {exc}", status=500))

    def _admit(self) -> None:
        busy = sum(len(r.seqs) for r in self._running)
        adapters = {r.adapter for r in self._running if r.adapter is not None}
        max_loras = self.lora.max_loras if self.lora is not None else 0
        skipped: list[GenRequest] = []
        while self._waiting and (
            not self._running or busy + len(self._waiting[0].seqs) <= self.max_batch
        ):
            request = self._waiting.popleft()
            new = request.adapter is not None and request.adapter not in adapters
            if new and self._running and len(adapters) >= max_loras:
                skipped.append(request)  # as vLLM: waits until a LoRA slot frees, others go on
                continue
            if new:
                adapters.add(request.adapter)
            self._running.append(request)
            busy += len(request.seqs)
        self._waiting.extendleft(reversed(skipped))

    async def _step(self) -> None:
        live = [s for r in self._running for s in r.seqs if s.finish_reason is None]
        version = self.version
        try:
            results = await asyncio.to_thread(self._forward_and_sample, live)
        except Exception as exc:  # a failed forward fails its requests, never the loop
            log.exception("forward pass failed")
            self._fail_running(EngineError(f"forward pass failed: {exc}", status=500))
            return
        for seq, (token, logprob, tops) in results:
            if seq.finish_reason is None:  # aborted while the step ran: drop its token
                self._append(seq, token, logprob, tops, version)

    def _fail_running(self, error: EngineError) -> None:
        """Resolve every running request with `error`; their sequences' KV is dropped."""
        for request in self._running:
            for seq in request.seqs:
                seq.drop_kv()
            request.resolve(error)
        self._running.clear()
        with contextlib.suppress(Exception):  # the batches may be what failed: start afresh
            self._release_batches()
        if self._batches is not None:
            self._batches.clear()
        self._update_gauges()

    def _append(
        self, seq: Sequence, token: int, logprob: float, tops: list[tuple[int, float]], version: str
    ) -> None:
        seq.tokens.append(token)
        seq.logprobs.append(logprob)
        seq.tops.append(tops)
        seq.versions.append(version)
        seq.pending = [token]
        metrics.TOKENS_GENERATED.inc()
        if token in seq.params.stop_token_ids:
            seq.finish_reason, seq.stop_reason = "stop", token
        elif token in self.eos_ids and not seq.params.ignore_eos:
            seq.finish_reason = "stop"
        elif len(seq.tokens) >= seq.params.max_tokens:
            seq.finish_reason = "length"
        elif len(seq.prompt) + len(seq.tokens) >= self.max_model_len:
            seq.finish_reason = "length"

    def _after_step(self) -> None:
        for request in self._running:
            request.stepped()
        for request in [r for r in self._running if r.finished()]:
            self._running.remove(request)
            try:
                for seq in request.seqs:
                    self._cache_finished(seq)
            finally:  # its tokens are whole: a failure to cache them is the engine's, not its
                request.resolve()
        if not self._running:
            self._release_batches()  # rows of requests that ended without finishing
        if not self._running and not self._waiting:
            self._drained.set()
            self._wake.clear()
        elif self.paused:
            self._wake.clear()
        self._update_gauges()

    def _update_gauges(self) -> None:
        metrics.RUNNING.set(sum(len(r.seqs) for r in self._running))
        metrics.WAITING.set(len(self._waiting) + len(self._held))

    def _cache_finished(self, seq: Sequence) -> None:
        """Give a finished sequence's KV (prompt and completion) to the prefix cache; free it."""
        if seq.batch is not None:
            seq.kv = seq.batch.take(seq)
        if seq.kv is not None:
            cache = self.prefix_cache
            past = seq.past_len
            history = seq.prompt + seq.tokens[: past - len(seq.prompt)]
            keys = cache.keys(history, past, seq.cache_salt)
            cache.insert(keys, seq.kv, seq.cache_epoch)
        seq.drop_kv()

    # --- worker-thread side ----------------------------------------------------------------
    def _plan(self, live: list[Sequence]) -> list[tuple[bool, int, list[Sequence]]]:
        """Attach cached prefixes to new sequences; split prefills from decodes, and by adapter
        (a forward pass applies one LoRA, or none): (is a prefill, adapter load id, sequences).

        A new sequence whose next uncached block another sequence prefills in this very step
        waits one step and then takes that block from the cache (a shared system prompt is
        prefilled once, not once per concurrent request).
        """
        computing: set[bytes] = set()
        prefill, decode = [], []
        for seq in live:
            if not seq.holds_kv and not self._attach_prefix(seq, computing):
                continue
            # still no KV (no cached prefix): all it saw is pending
            (prefill if not seq.holds_kv or len(seq.pending) > 1 else decode).append(seq)
        groups: dict[tuple[bool, int], list[Sequence]] = {}
        for is_prefill, seqs in ((True, prefill), (False, decode)):
            for seq in seqs:
                load_id = seq.adapter.load_id if seq.adapter is not None else 0
                groups.setdefault((is_prefill, load_id), []).append(seq)
        return [(is_prefill, load_id, seqs) for (is_prefill, load_id), seqs in groups.items()]

    def _attach_prefix(self, seq: Sequence, computing: set[bytes]) -> bool:
        """Give `seq` the KV of its longest cached prefix; False to defer it a step.

        Without KV, `pending` is everything the sequence has seen: its prompt, plus its tokens
        when a pause dropped its KV.
        """
        cache = self.prefix_cache
        seq.cache_epoch = cache.epoch
        if not cache.enabled:
            return True
        history = seq.pending
        seq.prompt_keys = cache.keys(history, len(history), seq.cache_salt)
        usable = seq.prompt_keys[: (len(history) - 1) // cache.block_size]  # >= 1 to prefill
        hit, kv = cache.match(usable)
        if hit < len(usable) and usable[hit] in computing:
            return False
        computing.update(usable[hit:])
        cache.count_query(len(history), hit * cache.block_size)
        if kv is not None:
            seq.kv = kv
            seq.pending = history[hit * cache.block_size :]
        return True

    def _forward_and_sample(
        self, live: list[Sequence]
    ) -> list[tuple[Sequence, tuple[int, float, list[tuple[int, float]]]]]:
        out = []
        with torch.inference_mode():
            plan = self._plan(live)
            if self._batches is not None:  # batches with no decode this step let their rows go
                decoding = {load_id for is_prefill, load_id, _ in plan if not is_prefill}
                for load_id in set(self._batches) - decoding:
                    self._batches.pop(load_id).sync([])
            for is_prefill, load_id, group in plan:
                metrics.BATCH_SIZE.observe(len(group))
                prefilling = [seq for seq in group if len(seq.pending) > 1]
                if is_prefill or self._batches is None:
                    logits = self._forward(group)
                else:
                    batch = self._batches.setdefault(load_id, DecodeBatch())
                    group = batch.sync(group)  # in row order, which the logits follow
                    logits = self._decode(batch, group[0].adapter)
                for seq in prefilling:  # concurrent sharers of this prompt find it next step
                    self.prefix_cache.insert(seq.prompt_keys, seq.kv or [], seq.cache_epoch)
                specs = [seq.params.spec for seq in group]
                tokens, logprobs, tops = sample_rows(
                    logits, specs, [seq.generator for seq in group]
                )
                out.extend(zip(group, zip(tokens, logprobs, tops, strict=True), strict=True))
        return out

    def _forward(self, group: list[Sequence]) -> torch.Tensor:
        """One forward pass over `group`; appends the new KV to each sequence; last-token logits."""
        past = max(s.past_len for s in group)
        width = max(len(s.pending) for s in group)
        batch = len(group)
        input_ids = torch.full((batch, width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((batch, past + width), dtype=torch.long)
        positions = torch.zeros((batch, width), dtype=torch.long)
        for i, seq in enumerate(group):
            n, p = len(seq.pending), seq.past_len
            input_ids[i, width - n :] = torch.tensor(seq.pending)
            mask[i, past - p : past] = 1
            mask[i, past + width - n :] = 1
            positions[i, width - n :] = torch.arange(p, p + n)
        cache = self._padded_cache(group, past)
        with self._applied(group[0].adapter):
            out = self.model(
                input_ids=input_ids,
                attention_mask=mask,
                position_ids=positions,
                use_cache=True,
                **{self._cache_arg: cache},
                logits_to_keep=1,
            )
        for i, seq in enumerate(group):
            n = len(seq.pending)
            seq.extend_kv(
                [(layer.keys[i, :, -n:], layer.values[i, :, -n:]) for layer in cache.layers]
            )
        return out.logits[:, -1, :]

    def _decode(self, batch: DecodeBatch, adapter: LoraAdapter | None) -> torch.Tensor:
        """One decode step of every row of `batch`, its KV written in place; the logits."""
        inputs = batch.step_inputs(self.model.config, self._cache_arg)
        with self._applied(adapter):
            out = self.model(**inputs, use_cache=True, logits_to_keep=1)
        batch.advance()
        return out.logits[:, -1, :]

    def _applied(self, adapter: LoraAdapter | None) -> contextlib.AbstractContextManager[None]:
        if self.lora is None:
            return contextlib.nullcontext()
        return self.lora.hooks.using(adapter)

    def _padded_cache(self, group: list[Sequence], past: int) -> DynamicCache:
        if past == 0:
            return DynamicCache(config=self.model.config)
        layers = []
        template = next(s.kv for s in group if s.kv)
        for layer, (k0, _) in enumerate(template):
            shape = (len(group), k0.shape[0], past, k0.shape[2])
            keys, values = torch.zeros(shape, dtype=k0.dtype), torch.zeros(shape, dtype=k0.dtype)
            for i, seq in enumerate(group):
                if seq.kv:
                    k, v = seq.kv[layer]
                    keys[i, :, past - k.shape[1] :] = k
                    values[i, :, past - v.shape[1] :] = v
            layers.append((keys, values))
        return DynamicCache(ddp_cache_data=layers, config=self.model.config)
