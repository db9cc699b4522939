"""vLLM 0.33's GPU sampler against the learner's kept set, on CUDA with bf16 logits.

For each setting (top-k, top-p, min-p, their mixes, low temperatures) and two batch sizes (24
rows: top-p rows without top-k take vLLM's split pipeline; 128 rows: every row takes its
monolithic kernel), bf16 logits from a random bf16 LM head go through vLLM 0.33's real
sampling steps on the GPU (tests/inference/vllm_contract/gpu_sampler.py: its temperature and
min-p kernels, then ``apply_top_k_top_p``, which runs its Triton kernels) and through the
project's (`inference.sampling.processed_logits`, and `learner.logprobs.chunked_logprobs` for
one target per row: the kept token with the smallest logit, the highest index among a tie).

It prints one line per (setting, batch): rows whose kept set differs, split into those where
vLLM keeps our set plus more of the tie at our boundary (the monolithic kernel's float-luck
miss, see tests/inference/vllm_contract/test_vllm_gpu_sampler.py) and any other difference;
rows where vLLM keeps part of a tie; the largest |logprob difference| over tokens both keep;
and the learner's largest |logprob difference| at its targets. It exits 1 if any row differs
otherwise than at the boundary tie (more of it, or another share of it), by the
minimum-logit or the temperature-0.01 top-p underflow departures.

Needs the vLLM bundle on PYTHONPATH (scripts/gpu_sampler_check.sh). ``--interpret`` runs it on
the CPU in Triton's interpreter (small sizes, the CUDA dispatch emulated) to test the script.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from broker.messages import Sampling
from inference.sampling import RowSampling, processed_logits
from learner.distribution import merged
from learner.logprobs import chunked_logprobs
from tests.inference.vllm_contract.gpu_sampler import Row, patch_triton_interpreter, processed

SETTINGS = {  # name: (temperature, top_k, top_p, min_p)
    "top-k 20": (1.0, 20, 1.0, 0.0),
    "top-k 50, T 0.7": (0.7, 50, 1.0, 0.0),
    "top-p 0.9": (1.0, 0, 0.9, 0.0),
    "top-p 0.5, T 0.7": (0.7, 0, 0.5, 0.0),
    "top-p 0.95, T 1.2": (1.2, 0, 0.95, 0.0),
    "min-p 0.05": (1.0, 0, 1.0, 0.05),
    "top-k 40, top-p 0.95, min-p 0.02": (1.0, 40, 0.95, 0.02),
    "top-p 0.9, min-p 0.1, T 0.6": (0.6, 0, 0.9, 0.1),
    "top-k 5, T 0.01": (0.01, 5, 1.0, 0.0),
    "top-p 0.9, T 0.01": (0.01, 0, 0.9, 0.0),
}


@dataclass(frozen=True)
class Sizes:
    vocab: int
    hidden: int
    batches: dict[str, int]  # label: rows (on CUDA the rows decide the dispatch, not the label)
    num_sm: int = 132  # the emulated GPU's SM count (interpreter only: CUDA asks the device)


GPU = Sizes(vocab=151_936, hidden=1024, batches={"small": 24, "large": 128})
# 16 SMs: 2 slices per row in the split pipeline, which the interpreter runs 8 times faster
INTERPRETED = Sizes(vocab=512, hidden=64, batches={"small": 6, "large": 6}, num_sm=16)


@dataclass
class Outcome:
    differ: dict[str, int] = field(default_factory=lambda: dict.fromkeys(KINDS, 0))
    partial_ties: int = 0
    max_logprob_diff: float = 0.0
    max_learner_diff: float = 0.0
    details: list[str] = field(default_factory=list)  # the first "other" rows, described


DETAILS = 3  # "other" rows described per cell


def _detail(ours: torch.Tensor, theirs: torch.Tensor, z: torch.Tensor, p: float) -> str:
    """Sizes of the two kept sets, what one keeps and not the other (count, logit range),
    and each set's mass under the row's min-p-masked distribution, against top-p."""
    probs = torch.softmax(z.float(), dim=-1)
    extra, missing = theirs & ~ours, ours & ~theirs

    def span(mask: torch.Tensor) -> str:
        if not mask.any():
            return "-"
        return f"{int(mask.sum())} z[{float(z[mask].min()):.4f},{float(z[mask].max()):.4f}]"

    return (
        f"ours {int(ours.sum())} mass {float(probs[ours].sum()):.7f}; vLLM {int(theirs.sum())} "
        f"mass {float(probs[theirs].sum()):.7f}; p {p}; vLLM extra {span(extra)}; "
        f"missing {span(missing)}; our floor z {float(z[ours].min()):.4f}"
    )


# How vLLM's kept set can differ from ours (docs/learner.md, "Ties"):
KINDS = {
    "ties": "vLLM keeps ours plus more of the tie at our boundary",
    "share": "vLLM keeps another share of the tie at our boundary (which or how many of it)",
    "minimum": "vLLM drops the tie at the row's smallest finite logit that our nucleus needs",
    "underflow": "T 0.01, top-p without top-k, monolithic kernel: vLLM keeps every token",
    "other": "anything else",
}


def _kind(ours: torch.Tensor, theirs: torch.Tensor, z: torch.Tensor, underflow: bool) -> str:
    """Which of KINDS a row whose kept sets differ is (`ours`, `theirs`: bool kept masks)."""
    floor = z[ours].min()
    extra, missing = theirs & ~ours, ours & ~theirs
    if not missing.any() and bool((z[extra] == floor).all()):
        return "ties"
    if not extra.any() and bool((z[missing] == z[torch.isfinite(z)].min()).all()):
        return "minimum"
    if bool((z[extra] == floor).all()) and bool((z[missing] == floor).all()):
        return "share"
    return "underflow" if underflow and bool(theirs[torch.isfinite(z)].all()) else "other"


def _head(sizes: Sizes, device: torch.device) -> torch.nn.Linear:
    """A random bf16 LM head (logits of a few units' spread, as a model's)."""
    gen = torch.Generator(device=device).manual_seed(0)
    head = torch.nn.Linear(sizes.hidden, sizes.vocab, bias=False, device=device)
    with torch.no_grad():
        weight = torch.randn(head.weight.shape, generator=gen, device=device)
        head.weight.copy_(weight * 3 / sizes.hidden**0.5)
    return head.to(torch.bfloat16)


def _hidden(rows: int, sizes: Sizes, device: torch.device) -> torch.Tensor:
    """bf16 hidden states: through the bf16 head, bf16 logits that tie where they round alike."""
    gen = torch.Generator(device=device).manual_seed(rows)
    return torch.randn((rows, sizes.hidden), generator=gen, device=device).to(torch.bfloat16)


def _compare(
    setting: tuple[float, int, float, float],
    rows: int,
    label: str,
    head: torch.nn.Linear,
    sizes: Sizes,
) -> Outcome:
    """One (setting, batch) cell of the table."""
    t, k, p, m = setting
    device, num_sm = head.weight.device, sizes.num_sm
    hidden = _hidden(rows, sizes, device)
    with torch.no_grad():
        logits = head(hidden)
    theirs = torch.log_softmax(processed(logits, [Row(t, k, p, m)] * rows, label, num_sm), dim=-1)
    samplings = [Sampling(t, k, p, m)] * rows
    ours = torch.log_softmax(
        processed_logits(logits, RowSampling.of(samplings, sizes.vocab, device)), -1
    )
    out = Outcome()
    targets = []
    z = processed(logits, [Row(t, 0, 1.0, m)] * rows, label, num_sm)  # masked by min-p alone
    for i in range(rows):
        a, b = torch.isfinite(ours[i]), torch.isfinite(theirs[i])
        low = z[i][b].min()
        targets.append(int(torch.nonzero(b & (z[i] == low)).max()))
        out.partial_ties += int(((z[i] == low) & ~b).any())
        both = a & b
        diff = float((ours[i] - theirs[i])[both].abs().max())
        out.max_logprob_diff = max(out.max_logprob_diff, diff)
        if not torch.equal(a, b):
            kind = _kind(a, b, z[i], t == 0.01 and not k and label == "large")
            out.differ[kind] += 1
            if kind == "other" and len(out.details) < DETAILS:
                out.details.append(_detail(a, b, z[i], p))
    sampling = merged([([samplings[0]], np.zeros(rows, np.int64))]).to(device)
    logp, _, _ = chunked_logprobs(
        hidden, head, torch.tensor(targets, device=device), sampling, rows
    )
    want = theirs[torch.arange(rows, device=device), torch.tensor(targets, device=device)]
    out.max_learner_diff = float((logp.float() - want).abs().max())
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--interpret", action="store_true", help="CPU, Triton's interpreter")
    parser.add_argument(
        "--only", action="append", choices=list(SETTINGS), help="run this setting (repeatable)"
    )
    args = parser.parse_args()
    if args.interpret:
        if os.environ.get("TRITON_INTERPRET") != "1":
            sys.exit("--interpret needs TRITON_INTERPRET=1 in the environment")
        patch_triton_interpreter()
        device, sizes = torch.device("cpu"), INTERPRETED
    else:
        if not torch.cuda.is_available():
            sys.exit("no CUDA device (use --interpret with TRITON_INTERPRET=1 on a CPU)")
        device, sizes = torch.device("cuda"), GPU
        print(torch.cuda.get_device_name(), "torch", torch.__version__, flush=True)
    import triton

    print(f"triton {triton.__version__}, vocabulary {sizes.vocab}, rows {sizes.batches}")
    head = _head(sizes, device)
    columns = "".join(f"{kind:>10}" for kind in KINDS)
    print(
        f"{'setting':<34}{'rows':>5}{columns}{'split':>6}{'max dlogp':>10}{'learner':>10}{'s':>6}"
    )
    other = 0
    for name in args.only or SETTINGS:
        setting = SETTINGS[name]
        for label, rows in sizes.batches.items():
            start = time.monotonic()
            o = _compare(setting, rows, label, head, sizes)
            other += o.differ["other"]
            counts = "".join(f"{o.differ[kind]:>10}" for kind in KINDS)
            print(
                f"{name:<34}{rows:>5}{counts}{o.partial_ties:>6}{o.max_logprob_diff:>10.2e}"
                f"{o.max_learner_diff:>10.2e}{time.monotonic() - start:>6.1f}",
                flush=True,
            )
            for line in o.details:
                print(f"    other: {line}", flush=True)
    print("Rows whose kept set differs from the learner's, by kind:")
    for kind, what in KINDS.items():
        print(f"  {kind}: {what}")
    print(
        "split: rows where vLLM kept part of a tie; max dlogp: largest |logprob difference| over "
        "tokens both keep; learner: largest |difference| of the learner's logprob (chunked) at "
        "each row's last kept tie from vLLM's"
    )
    return 1 if other else 0


if __name__ == "__main__":
    sys.exit(main())
