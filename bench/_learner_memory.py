"""`python -m bench learner --memory`: peak memory of one training step at long sequences.

The model is built locally from a Qwen2-style config (`SHAPES["full"]`: hidden 512, 8 layers,
8 heads / 2 KV heads, MLP 1408, vocabulary 151,936, tied embeddings; random weights, no
download); about 100M parameters, most of them in the embedding. Each row is a fresh process (so its peak
resident set is its own) training one AdamW step, twice, on sequences of the given length,
activation checkpointing on:

* ``chunked``: the learner's path (`learner.trainer.Trainer`, LM head in 256-token chunks
  over 8192-column vocabulary tiles, fused AdamW);
* ``full``: the same step with the logits materialised for the whole sequence
  (``lm(...).logits``, then log_softmax), what the learner did before chunking;
* ``fsdp-1`` / ``fsdp-2``: the chunked step on 2 sequences, one process vs two gloo ranks
  under torchrun (peak per rank).

The analytic floor, printed beside each row, is 16 bytes per parameter (fp32 weights,
gradients, two AdamW moments; divided by the ranks under FSDP) + the checkpointed layer
inputs and final hidden states (4 x tokens x hidden x (layers + 1)) + one layer's
recomputed activations (4 x tokens x (4 hidden + 3 MLP)). Peak = the kernel's high-water
mark of the resident set (VmHWM, reset after the model is built and sharded, so the one-off
load is not counted) minus the resident set before the model was built; malloc live = the
peak of what malloc has handed out and not had back (`mallinfo2`, sampled every 5 ms), which
leaves out freed heap that glibc keeps resident. The weight export row
streams the full weights out of the shards (`learner.export`) and reports the peak extra
resident memory on the writing rank (sampled every 2 ms) against the model's size.
``--lora-rank R`` adds ``lora-R`` rows: the chunked step training LoRA adapters of rank R on
the q, k, v, o projections (`learner.lora`), the rest frozen; their floor counts gradients
and AdamW moments of the adapter only.
`--quick`: 2048 tokens only; `--smoke` (CI): chunked and full at 256 tokens, on a small model
of the same shape (`SHAPES["smoke"]`: hidden 64, 2 layers, 4 heads / 2 KV heads, vocabulary
16,384, two vocabulary tiles), so each row's process is mostly its start-up.
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bench import _report as report
from launch.settings import HelpFormatter

if TYPE_CHECKING:  # torch loads inside the measured subprocesses only
    from learner.distributed import DistContext
    from learner.trainer import Trainer


@dataclass(frozen=True)
class Shape:
    """The Qwen2-style model's dimensions."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    mlp: int  # intermediate size
    vocab: int


SHAPES = {
    "full": Shape(hidden=512, layers=8, heads=8, kv_heads=2, mlp=1408, vocab=151_936),
    # CI: the same code paths (GQA, tied embeddings, two 8192-column vocabulary tiles) in seconds
    "smoke": Shape(hidden=64, layers=2, heads=4, kv_heads=2, mlp=176, vocab=16_384),
}
CHUNK = 256  # LM-head chunk; its logits are [256, 8192] vocabulary tiles (8 MiB each)
MIB = 2**20


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def reset_peak() -> None:
    """Give freed heap back to the OS, then restart the kernel's high-water mark (VmHWM)."""
    ctypes.CDLL(ctypes.util.find_library("c")).malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


class _Mallinfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


def malloc_live() -> int:
    """Bytes malloc has handed out and not had back (heap in use + mmapped blocks)."""
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    libc.mallinfo2.restype = _Mallinfo2
    info = libc.mallinfo2()
    return int(info.uordblks + info.hblkhd)


class LivePeak:
    """The peak of `malloc_live` over a block, sampled every 5 ms in a thread.

    The resident set also holds freed heap that glibc has not returned (a freed [T, H]
    tensor below the mmap threshold stays resident); this is what the tensors alive need.
    """

    def __init__(self) -> None:
        self.peak, self._done = 0, threading.Event()
        self._thread = threading.Thread(target=self._sample, name="malloc-sampler")

    def _sample(self) -> None:
        while not self._done.is_set():
            self.peak = max(self.peak, malloc_live())
            time.sleep(0.005)

    def __enter__(self) -> LivePeak:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._thread.join()


def peak_rss() -> int:
    with open("/proc/self/status") as f:
        hwm = next(line for line in f if line.startswith("VmHWM:"))
    return int(hwm.split()[1]) * 1024


def build_model(shape: Shape) -> Any:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(
        vocab_size=shape.vocab,
        hidden_size=shape.hidden,
        intermediate_size=shape.mlp,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        tie_word_embeddings=True,
        max_position_embeddings=65_536,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    return Qwen2ForCausalLM(cfg).float()


def samples(n: int, length: int, vocab: int) -> list[Any]:
    import numpy as np

    from broker.messages import Sampling
    from learner.batch import Sample

    rng = np.random.default_rng(0)
    mask = np.ones(length, np.float32)
    mask[0] = 0
    return [
        Sample(
            input_ids=rng.integers(1, vocab, length),
            loss_mask=mask,
            behaviour_logp=-rng.uniform(5, 15, length).astype(np.float32),
            advantages=np.full(length, 1.0 - 2 * (i % 2), np.float32),
            sampling_index=np.zeros(length, np.int32),  # every token drawn at temperature 1
            stale=False,
            group_id=f"s{i}",
            samplings=(Sampling(1.0),),
        )
        for i in range(n)
    ]


def full_logits_policy(lm: Any) -> Any:
    """The pre-chunking computation: logits for every position, then log_softmax."""
    import torch

    from learner.logprobs import full_logprobs
    from learner.policy import PolicyModel

    class FullLogits(PolicyModel):
        def forward(self, batch: dict[str, Any]) -> Any:
            logits = self.lm(
                input_ids=batch["input_ids"],
                attention_mask=batch.get("attention_mask"),
                position_ids=batch["position_ids"],
                use_cache=False,
            ).logits
            flat = logits.reshape(-1, logits.shape[-1]).index_select(0, batch["src"])
            logp, entropy = full_logprobs(flat, batch["targets"], batch["sampling"])
            return logp, entropy, torch.zeros_like(logp)  # the benchmark samples unrestricted

    return FullLogits(lm, 0)


def run_case(mode: str, length: int, sequences: int, shape: Shape) -> dict[str, Any]:
    """One row, in this process (under torchrun for fsdp-2)."""
    import torch

    from learner.config import Aggregation, OptimConfig, ScaleConfig
    from learner.distributed import init_distributed
    from learner.trainer import Trainer

    torch.set_num_threads(1 if mode == "fsdp-2" else 2)
    base, live_base = rss(), malloc_live()
    dist = init_distributed(torch.device("cpu"))
    model = build_model(shape)
    params = sum(p.numel() for p in model.parameters())
    trainable = params
    if mode.startswith("lora-"):  # adapters on q,k,v,o; the rest frozen (learner.lora)
        from learner.lora import LoraSettings, apply_lora

        apply_lora(model, LoraSettings(rank=int(mode.removeprefix("lora-"))), Path("base"))
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        params = sum(p.numel() for p in model.parameters())
    optim = OptimConfig(
        learning_rate=1e-5,
        weight_decay=0.0,
        clip_low=0.2,
        clip_high=0.2,
        tis_cap=2.0,
        max_grad_norm=1.0,
        micro_batch_size=1,
        aggregation=Aggregation.TOKEN_MEAN,
    )
    scale = ScaleConfig(
        max_tokens_per_micro_batch=length,
        packing=False,
        logprob_chunk_tokens=CHUNK,
        activation_checkpointing=True,
    )
    trainer = Trainer(model, optim, torch.device("cpu"), dist, scale=scale)
    if mode == "full":
        trainer.policy = full_logits_policy(trainer.model)
    batch = samples(sequences, length, shape.vocab)
    tokens = sequences * (length - 1)
    reset_peak()  # the peak of the training steps, not of building and sharding the model
    times = []
    with LivePeak() as live:
        for _ in range(2):  # the first step also allocates the AdamW state
            started = time.perf_counter()
            trainer.step(batch, tokens, sequences)
            times.append(time.perf_counter() - started)
    peak = peak_rss() - base
    row = {
        "mode": mode,
        "length": length,
        "sequences": sequences,
        "world": dist.world,
        "params": params,
        "peak": peak,
        "live_peak": live.peak - live_base,
        "step_s": times[-1],
        "trainable": trainable,
        "floor": floor(shape, params, length * sequences // dist.world, dist.world, trainable),
    }
    if mode == "fsdp-2":
        row["export"] = export_peak(trainer, dist)
    dist.close()
    return row


def floor(shape: Shape, params: int, tokens: int, world: int, trainable: int | None = None) -> int:
    # fp32 weights, and a gradient and two AdamW moments of what trains
    states = (4 * params + 12 * (params if trainable is None else trainable)) // world
    h = shape.hidden
    return states + 4 * tokens * h * (shape.layers + 1) + 4 * tokens * (4 * h + 3 * shape.mlp)


def export_peak(trainer: Trainer, dist: DistContext) -> dict[str, int]:
    """Peak extra RSS on the writing rank while the full weights stream out of the shards."""
    from learner.export import write_safetensors

    before, peak, done = rss(), [0], threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], rss() - before)
            time.sleep(0.002)

    sampler = threading.Thread(target=sample, name="rss-sampler")
    sampler.start()
    with tempfile.TemporaryDirectory() as tmp:
        largest = write_safetensors(trainer.model, Path(tmp) / "w.safetensors", dist.is_main)
        size = (Path(tmp) / "w.safetensors").stat().st_size if dist.is_main else 0
    done.set()
    sampler.join()
    return {"peak_extra": peak[0], "largest_tensor": largest, "file": size}


def _spawn(
    mode: str, length: int, sequences: int, shape: str, out: Path, *, malloc: str
) -> list[dict[str, Any]]:
    case = ["-m", "bench._learner_memory", "case", mode, str(length), str(sequences), shape]
    case += [str(out), malloc]
    cmd = [sys.executable, *case]
    if mode == "fsdp-2":
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            *case,
        ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    if done.returncode != 0:
        raise RuntimeError(f"{mode} at {length} failed:\n{done.stderr[-3000:]}")
    return [json.loads(p.read_text()) for p in sorted(out.parent.glob(out.name + ".*"))]


def _available() -> int:
    with open("/proc/meminfo") as f:
        info = dict(line.split(":", 1) for line in f)
    return int(info["MemAvailable"].split()[0]) * 1024


def _fmt(row: dict[str, Any]) -> str:
    tokens = row["length"] * row["sequences"]
    return (
        f"| {row['mode']} | {row['length']} | {row['sequences']} | {row['world']} | "
        f"{row['peak'] / MIB:,.0f} | {row['floor'] / MIB:,.0f} | "
        f"{row['peak'] / row['floor']:.2f} | {row['live_peak'] / MIB:,.0f} | "
        f"{row['live_peak'] / row['floor']:.2f} | {row['step_s']:.1f} | "
        f"{row['sequences'] / row['step_s']:.3f} | {tokens / row['step_s']:,.0f} |"
    )


def plan(
    lengths: list[int], fsdp_length: int, modes: list[str], lora_rank: int = 0
) -> list[tuple[str, int, int]]:
    rows = [(mode, n, 1) for n in lengths for mode in ("chunked", "full") if mode in modes]
    if lora_rank:  # the chunked step training only LoRA adapters, beside full fine-tuning
        rows += [(f"lora-{lora_rank}", n, 1) for n in lengths]
    if "fsdp" in modes:
        rows += [("fsdp-1", fsdp_length, 2), ("fsdp-2", fsdp_length, 2)]
    return rows


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench learner --memory", formatter_class=HelpFormatter
    )
    parser.add_argument(
        "--lengths",
        default="2048,8192,16384",
        help="tokens per sequence of the chunked/full rows (empty: FSDP rows only)",
    )
    parser.add_argument("--fsdp-length", type=int, default=1024, help="tokens per sequence (x2)")
    parser.add_argument("--modes", default="chunked,full,fsdp", help="rows to run")
    parser.add_argument("--quick", action="store_true", help="2048 tokens only")
    parser.add_argument("--smoke", action="store_true", help="chunked and full at 256 (CI)")
    parser.add_argument("--json", action="store_true", help="print JSON (the table to stderr)")
    parser.add_argument(
        "--malloc",
        choices=("learner", "glibc"),
        default="learner",
        help="the row process's malloc: the learner's settings (broker.memory.LEARNER), "
        "or glibc's defaults (rows before 2026-11-28)",
    )
    parser.add_argument(
        "--lora-rank",
        type=int,
        default=0,
        help="also the chunked step with LoRA adapters of this rank on q,k,v,o",
    )
    args = parser.parse_args([a for a in argv if a != "--memory"])
    run = report.start("learner", argv)
    lengths = [int(x) for x in args.lengths.split(",") if x]
    modes, shape = args.modes.split(","), "full"
    if args.quick:
        lengths = [2048]
    if args.smoke:
        lengths, modes, shape = [256], ["chunked", "full"], "smoke"
    lines = [
        "| mode | tokens/seq | seqs | ranks | peak MiB (per rank) | floor MiB | peak/floor "
        "| malloc live MiB | live/floor | step s | samples/s | tokens/s |"
        "\n|---|---|---|---|---|---|---|---|---|---|---|---|"
    ]
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for mode, length, seqs in plan(lengths, args.fsdp_length, modes, args.lora_rank):
            # logits, log_softmax, its exp (entropy) and a gradient: 4 x [T, V] float32
            need = 4 * 4 * length * SHAPES[shape].vocab * seqs if mode == "full" else 0
            if need > 0.6 * _available():
                lines.append(
                    f"| {mode} | {length} | {seqs} | 1 | not run: needs > {need / 2**30:.0f}"
                    f" GiB, {_available() / 2**30:.0f} GiB available | | | | | | | |"
                )
                continue
            out = Path(tmp) / f"{mode}-{length}.json"
            for row in _spawn(mode, length, seqs, shape, out, malloc=args.malloc):
                rows.append(row)
                lines.append(_fmt(row))
                print(lines[-1], file=sys.stderr, flush=True)  # progress: rows take minutes
    lines += _summary(rows)
    return report.emit(run, rows, "\n".join(lines), args.json)


def _summary(rows: list[dict[str, Any]]) -> list[str]:
    out = []
    one = [r for r in rows if r["mode"] == "fsdp-1"]
    two = [r for r in rows if r["mode"] == "fsdp-2"]
    if one and two:
        per_rank = max(r["peak"] for r in two)
        out.append(
            f"\nFSDP: peak per rank {per_rank / MIB:,.0f} MiB with 2 ranks vs "
            f"{one[0]['peak'] / MIB:,.0f} MiB in one process (ratio {per_rank / one[0]['peak']:.2f}); "
            f"parameter + AdamW state per rank {16 * one[0]['params'] / 2 / MIB:,.0f} vs "
            f"{16 * one[0]['params'] / MIB:,.0f} MiB"
        )
    for r in two:
        if r["export"]["file"]:
            e = r["export"]
            out.append(
                f"weight export from shards (rank 0 writes): peak extra RSS "
                f"{e['peak_extra'] / MIB:,.0f} MiB, largest tensor {e['largest_tensor'] / MIB:,.0f}"
                f" MiB, model file {e['file'] / MIB:,.0f} MiB "
                f"(ratio to the model {e['peak_extra'] / e['file']:.2f})"
            )
    return out


if __name__ == "__main__" and sys.argv[1:2] == ["case"]:
    _, _, mode, length, sequences, shape, out, malloc = sys.argv
    if malloc == "learner":  # what `python -m learner` sets at start-up
        from broker.memory import LEARNER, tune_malloc

        tune_malloc(LEARNER)
    result = run_case(mode, int(length), int(sequences), SHAPES[shape])
    Path(f"{out}.{os.environ.get('RANK', '0')}").write_text(json.dumps(result))
