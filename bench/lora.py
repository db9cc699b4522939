"""LoRA weight push against the full-weight file push, on the CPU policy server.

Per model: a full push is `FileWeightSync.push` (save the whole model as safetensors, pause,
`reload_weights`, version, resume, verify); an adapter push is what a LoRA learner does per
version: peft's `save_pretrained` of the adapter, `AdapterSync.load` (`/v1/load_lora_adapter`
on the server, then the `/v1/models` check) and `AdapterSync.unload` of the version before.
Bytes are the safetensors file each push writes and the server reads. The adapter is rank
`--rank` (alpha 2r) on every linear layer of the decoder (q, k, v, o, gate, up, down).
A last row compares generation with the adapter applied on the fly against the base model
(tokens/s, `--concurrency` requests at once). Models: the tiny test architecture at a given size,
and SmolLM2-135M-Instruct (`inference.models`) unless `--smoke` or `--no-smollm2`.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import aiohttp

from bench import _report as report
from launch.settings import HelpFormatter

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


async def _tokens_per_s(url: str, model: str | None, concurrency: int, tokens: int) -> float:
    body: dict[str, Any] = {"max_tokens": tokens, "ignore_eos": True, "return_token_ids": True}
    if model is not None:
        body["model"] = model
    async with aiohttp.ClientSession() as session:

        async def one(i: int) -> int:
            request = body | {"prompt": [10 + i, 11, 12, 13], "seed": i}
            async with session.post(url + "/v1/completions", json=request) as resp:
                assert resp.status == 200, await resp.text()
                return len((await resp.json())["choices"][0]["token_ids"])

        started = time.perf_counter()
        done = await asyncio.gather(*(one(i) for i in range(concurrency)))
        return sum(done) / (time.perf_counter() - started)


def _peft_model(model_dir: Path, rank: int) -> Any:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=TARGETS)
    with warnings.catch_warnings():  # peft 0.21 reads a deprecated transformers property
        warnings.filterwarnings("ignore", ".*is_gradient_checkpointing.*", FutureWarning)
        peft_model = get_peft_model(model, config)
    with torch.no_grad():  # a trained adapter is nonzero; peft starts lora_B at zero
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.01)
    return peft_model


async def _measure(model_dir: Path, work: Path, args: argparse.Namespace) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    from inference.adapter_sync import AdapterSync, adapter_name
    from inference.config import ServerConfig, WeightSyncConfig
    from inference.server import PolicyServer
    from inference.weight_sync import FileWeightSync

    config = ServerConfig(
        model=model_dir,
        port=0,
        enable_lora=True,
        max_lora_rank=64,
        max_loras=2,
        max_batch_size=max(64, args.concurrency),
    )
    full_s, adapter_s, save_s, load_s, unload_s = [], [], [], [], []
    async with PolicyServer(config) as server:
        files = FileWeightSync(
            [server.url], WeightSyncConfig(root_dir=work / "full", keep_versions=1)
        )
        adapters = AdapterSync([server.url], WeightSyncConfig(root_dir=work / "lora"))
        model = AutoModelForCausalLM.from_pretrained(model_dir)
        full_path = Path()
        for version in range(1, args.repeats + 1):
            started = time.perf_counter()
            full_path = await files.push(model, None, version)
            full_s.append(time.perf_counter() - started)
        del model
        peft_model = _peft_model(model_dir, args.rank)
        name = ""
        for version in range(1, args.repeats + 1):
            path, previous = work / "lora" / f"v{version}", name
            name = adapter_name("bench", version)
            started = time.perf_counter()
            await asyncio.to_thread(peft_model.save_pretrained, path)
            saved = time.perf_counter()
            await adapters.load(name, path, version)
            loaded = time.perf_counter()
            if previous:
                await adapters.unload(previous)
            done = time.perf_counter()
            save_s.append(saved - started)
            load_s.append(loaded - saved)
            unload_s.append(done - loaded)
            adapter_s.append(done - started)
        base_tok_s = await _tokens_per_s(server.url, None, args.concurrency, args.tokens)
        lora_tok_s = await _tokens_per_s(server.url, name, args.concurrency, args.tokens)
    full_bytes = sum(f.stat().st_size for f in full_path.glob("*.safetensors"))
    adapter_bytes = (work / "lora" / f"v{args.repeats}" / "adapter_model.safetensors").stat()
    return {
        "model": str(model_dir),
        "full_bytes": full_bytes,
        "adapter_bytes": adapter_bytes.st_size,
        "full_push_s": statistics.median(full_s),
        "adapter_push_s": statistics.median(adapter_s),
        "adapter_save_s": statistics.median(save_s),
        "adapter_load_s": statistics.median(load_s),
        "adapter_unload_s": statistics.median(unload_s) if args.repeats > 1 else 0.0,
        "base_tok_s": base_tok_s,
        "lora_tok_s": lora_tok_s,
    }


async def _run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from inference.tiny import build_tiny_model

    torch.set_num_threads(args.threads)
    results: dict[str, Any] = {
        "rank": args.rank,
        "repeats": args.repeats,
        "threads": args.threads,
        "models": {},
    }
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        heads = max(4, args.hidden // 64)
        tiny = build_tiny_model(
            work / "tiny",
            seed=0,
            hidden_size=args.hidden,
            num_layers=args.layers,
            num_heads=heads,
            num_kv_heads=max(1, heads // 2),
        )
        label = f"tiny (hidden {args.hidden}, {args.layers} layers)"
        results["models"][label] = await _measure(tiny, work / "t", args)
        if args.smollm2:
            from inference.models import ensure_model

            smol = ensure_model("smollm2")
            results["models"]["SmolLM2-135M"] = await _measure(smol, work / "s", args)
    return results


def _table(r: dict[str, Any]) -> str:
    lines = [
        f"adapter: rank {r['rank']}, alpha {2 * r['rank']}, on {', '.join(TARGETS)}; "
        f"median of {r['repeats']} pushes; torch threads {r['threads']}",
        f"{'model':<30}{'measure':<34}{'full':>12}{'adapter':>12}{'ratio':>9}",
    ]
    for label, m in r["models"].items():
        rows = [
            ("bytes per version (MB)", m["full_bytes"] / 1e6, m["adapter_bytes"] / 1e6, ".2f"),
            ("push per version (s)", m["full_push_s"], m["adapter_push_s"], ".4f"),
        ]
        for measure, full, adapter, fmt in rows:
            lines.append(
                f"{label:<30}{measure:<34}{full:>12{fmt}}{adapter:>12{fmt}}{full / adapter:>8.1f}x"
            )
        lines.append(
            f"{'':<30}{'  adapter: save / load / unload':<34}"
            f"{m['adapter_save_s']:.4f} / {m['adapter_load_s']:.4f} / {m['adapter_unload_s']:.4f}"
        )
        lines.append(
            f"{'':<30}{'tokens/s base vs adapter':<34}{m['base_tok_s']:>12.0f}"
            f"{m['lora_tok_s']:>12.0f}{m['base_tok_s'] / m['lora_tok_s']:>8.2f}x"
        )
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench lora", description=__doc__, formatter_class=HelpFormatter
    )
    parser.add_argument("--smoke", action="store_true", help="the smallest sizes (CI)")
    parser.add_argument("--json", action="store_true", help="print JSON (the table to stderr)")
    parser.add_argument("--threads", type=int, default=min(4, os.cpu_count() or 1))
    parser.add_argument("--rank", type=int, default=16, help="adapter rank (alpha is 2 x rank)")
    parser.add_argument(
        "--no-smollm2", dest="smollm2", action="store_false", help="only the tiny architecture"
    )
    args = parser.parse_args(argv)
    run = report.start("lora", argv)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    if args.smoke:
        args.hidden, args.layers, args.repeats, args.concurrency, args.tokens = 64, 2, 2, 2, 4
        args.smollm2 = False
    else:
        args.hidden, args.layers, args.repeats, args.concurrency, args.tokens = 512, 12, 5, 8, 32
    result = asyncio.run(_run(args))
    return report.emit(run, result, _table(result), args.json)
