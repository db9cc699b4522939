"""Inference benchmark: CPU policy server throughput with batching, and weight reload against disk.

Throughput: C concurrent `/v1/completions` requests (each T tokens, EOS ignored) through a real
in-process server over loopback, against the same requests sent one at a time; the ratio is
the gain from shared forward passes. Weight sync: `POST /collective_rpc reload_weights` of a
saved safetensors directory, and a full `FileWeightSync.push` (save + pause + reload + version +
resume + verify), each against a safetensors save of the same model plus fsync in the same run
(the floor of any file-based sync); and the same push over vLLM's NCCL routes, the tensors
broadcast over the CPU server's gloo group (`NcclWeightSync`, no files), against the file push. The full run's model has >= 100 MB of float32 weights (hidden
512, 12 layers, ~114 MB); target: push <= 1.5x the save + fsync. Medians over repeats.
Multi-turn (see `_multiturn.py`): concurrent episodes whose prompts grow turn by turn over a
shared system prompt, on a server with the prefix cache on against one with it off; one run
each (it is long), on the small model of `--quick` so the cache-off side finishes on a laptop.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import statistics
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import aiohttp

from bench import _report as report
from bench._multiturn import MultiTurn, compare, table_rows
from launch.settings import HelpFormatter

if TYPE_CHECKING:  # torch and the model stack load inside the benchmarks that need them
    from inference.server import PolicyServer


def _median(values: list[float]) -> float:
    return statistics.median(values)


async def _throughput(url: str, concurrency: int, tokens: int, repeats: int) -> dict[str, float]:
    body = {
        "prompt": list(range(1, 33)),
        "max_tokens": tokens,
        "ignore_eos": True,
        "logprobs": 0,
        "return_token_ids": True,
    }
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:

        async def one() -> int:
            async with session.post(url + "/v1/completions", json=body) as resp:
                data = await resp.json()
                return len(data["choices"][0]["token_ids"])

        await one()  # warm-up
        batched, single = [], []
        for _ in range(repeats):
            started = time.perf_counter()
            counts = await asyncio.gather(*(one() for _ in range(concurrency)))
            batched.append(sum(counts) / (time.perf_counter() - started))
            started, total = time.perf_counter(), 0
            for _ in range(max(2, concurrency // 8)):
                total += await one()
            single.append(total / (time.perf_counter() - started))
    return {"batched_tok_s": _median(batched), "single_tok_s": _median(single)}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _save_floor(model: Any, directory: Path) -> float:
    """Seconds for a plain safetensors save of `model` plus fsync: the floor of any file sync."""
    from safetensors.torch import save_model

    target = directory / "floor.safetensors"
    started = time.perf_counter()
    save_model(model, str(target))  # drops tied duplicates, as save_pretrained does
    with open(target, "rb+") as fh:
        os.fsync(fh.fileno())
    elapsed = time.perf_counter() - started
    target.unlink()
    return elapsed


async def _weight_sync(
    server: PolicyServer, model_dir: Path, work: Path, repeats: int
) -> dict[str, float]:
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from inference.config import WeightSyncConfig
    from inference.nccl import NcclTransport, gloo_trainer_init
    from inference.weight_sync import FileWeightSync, NcclWeightSync

    weights = model_dir / "model.safetensors"
    tensors = load_file(weights)  # the file's bytes: tied weights once
    port = _free_port()
    gloo = NcclWeightSync(
        [server.url],
        WeightSyncConfig(root_dir=work),
        NcclTransport("127.0.0.1", port, trainer_init=gloo_trainer_init(60)),
    )
    await gloo.init()
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    sync = FileWeightSync(
        [server.url], WeightSyncConfig(root_dir=work / "weights", keep_versions=1)
    )
    rpc = {"method": "reload_weights", "kwargs": {"weights_path": str(model_dir)}}
    reload_s, push_s, floor_s, gloo_s = [], [], [], []
    async with aiohttp.ClientSession() as session:
        for version in range(1, repeats + 1):
            floor_s.append(_save_floor(model, work))
            started = time.perf_counter()
            async with session.post(server.url + "/collective_rpc", json=rpc) as resp:
                assert resp.status == 200, await resp.text()
            reload_s.append(time.perf_counter() - started)
            started = time.perf_counter()
            await sync.push(model, None, version)
            push_s.append(time.perf_counter() - started)
            started = time.perf_counter()
            await gloo.push(tensors, repeats + version)
            gloo_s.append(time.perf_counter() - started)
    gloo.close()
    return {
        "weight_bytes": weights.stat().st_size,
        "save_fsync_s": _median(floor_s),
        "reload_s": _median(reload_s),
        "push_s": _median(push_s),
        "gloo_push_s": _median(gloo_s),
    }


def _forward_ceiling(model_dir: Path, concurrency: int, tokens: int) -> dict[str, float]:
    """The model alone (transformers, greedy, a KV cache, no server): decode tokens/s with
    `concurrency` rows against one, at the throughput row's context (32-token prompt). What a
    server's batching can reach at best on this machine, measured in the same run."""
    import torch
    from transformers import AutoModelForCausalLM, DynamicCache

    from inference.decode_batch import cache_kwarg

    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    cache_arg = cache_kwarg(model)
    rates = {}
    for rows in (1, concurrency):
        cache = DynamicCache(config=model.config)
        step = {"use_cache": True, "logits_to_keep": 1, cache_arg: cache}
        with torch.inference_mode():
            out = model(input_ids=torch.arange(1, 33).repeat(rows, 1), **step)
            started = time.perf_counter()
            for _ in range(tokens):
                out = model(input_ids=out.logits[:, -1].argmax(-1, keepdim=True), **step)
            rates[rows] = rows * tokens / (time.perf_counter() - started)
    return {"ceiling_batched_tok_s": rates[concurrency], "ceiling_single_tok_s": rates[1]}


async def _run_model(args: argparse.Namespace) -> dict[str, Any]:
    """Throughput only, on a given model directory (e.g. `python -m inference.models smollm2`)."""
    import torch

    from inference.config import ServerConfig
    from inference.server import PolicyServer

    torch.set_num_threads(args.threads)
    config = ServerConfig(model=args.model, port=0, max_batch_size=max(64, args.concurrency))
    async with PolicyServer(config) as server:
        result = await _throughput(server.url, args.concurrency, args.tokens, args.repeats)
    result |= _forward_ceiling(args.model, args.concurrency, args.tokens)
    if args.multi_turn:
        result |= await compare(args.model, args.load, args.kv_cache_mb)
    result |= {
        "model": str(args.model),
        "concurrency": args.concurrency,
        "tokens": args.tokens,
        "threads": args.threads,
    }
    result["batching_ratio"] = result["batched_tok_s"] / result["single_tok_s"]
    result["ceiling_ratio"] = result["ceiling_batched_tok_s"] / result["ceiling_single_tok_s"]
    return result


async def _run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from inference.config import ServerConfig
    from inference.server import PolicyServer
    from inference.tiny import build_tiny_model

    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        if args.multi_turn_only:
            return await compare(build_tiny_model(work / "mt", seed=0), args.load, args.kv_cache_mb)
        heads = max(4, args.hidden // 64)
        model_dir = build_tiny_model(
            work / "model",
            seed=0,
            hidden_size=args.hidden,
            num_layers=args.layers,
            num_heads=heads,
            num_kv_heads=max(1, heads // 2),
        )
        config = ServerConfig(model=model_dir, port=0, max_batch_size=max(64, args.concurrency))
        async with PolicyServer(config) as server:
            result = await _throughput(server.url, args.concurrency, args.tokens, args.repeats)
            result |= await _weight_sync(server, model_dir, work, args.repeats)
        if args.load.episodes:
            mt_model = build_tiny_model(work / "mt", seed=0)
            result |= await compare(mt_model, args.load, args.kv_cache_mb)
    result |= {
        "hidden": args.hidden,
        "layers": args.layers,
        "concurrency": args.concurrency,
        "tokens": args.tokens,
        "threads": args.threads,
    }
    result["batching_ratio"] = result["batched_tok_s"] / result["single_tok_s"]
    result["reload_over_write"] = result["reload_s"] / result["save_fsync_s"]
    result["push_over_write"] = result["push_s"] / result["save_fsync_s"]
    result["gloo_over_file"] = result["gloo_push_s"] / result["push_s"]
    return result


def _table(r: dict[str, Any], load: MultiTurn) -> str:
    if "model" in r:  # --model DIR
        label = f"tokens/s, {r['concurrency']} concurrent x {r['tokens']} tok"
        return "\n".join(
            [
                f"model: {r['model']}; torch threads {r['threads']}",
                f"{'measure':<44}{'value':>12}{'baseline':>12}{'ratio':>8}",
                f"{label:<44}{r['batched_tok_s']:>12.1f}"
                f"{r['single_tok_s']:>12.1f}{r['batching_ratio']:>7.1f}x   (baseline: one request at a time)",
                f"{'the model alone, ' + str(r['concurrency']) + ' rows vs 1 (ceiling)':<44}"
                f"{r['ceiling_batched_tok_s']:>12.1f}{r['ceiling_single_tok_s']:>12.1f}"
                f"{r['ceiling_ratio']:>7.1f}x   (transformers forward + KV cache, no server)",
                *(table_rows(r, load) if "mt_tok_ratio" in r else []),
            ]
        )
    if "weight_bytes" not in r:  # --multi-turn-only
        return "\n".join(["model: the tiny test model (hidden 64, 2 layers)", *table_rows(r, load)])
    mb = r["weight_bytes"] / 1e6
    label = f"tokens/s, {r['concurrency']} concurrent x {r['tokens']} tok"
    return "\n".join(
        [
            f"model: hidden {r['hidden']}, {r['layers']} layers, {mb:.1f} MB float32; torch threads {r['threads']}",
            f"{'measure':<44}{'value':>12}{'baseline':>12}{'ratio':>8}",
            f"{label:<44}{r['batched_tok_s']:>12.0f}"
            f"{r['single_tok_s']:>12.0f}{r['batching_ratio']:>7.1f}x   (baseline: one request at a time)",
            f"{'reload_weights (s)':<44}{r['reload_s']:>12.4f}{r['save_fsync_s']:>12.4f}"
            f"{r['reload_over_write']:>7.1f}x   (baseline: safetensors save + fsync, same model)",
            f"{'FileWeightSync.push: save+reload+verify (s)':<44}{r['push_s']:>12.4f}{r['save_fsync_s']:>12.4f}"
            f"{r['push_over_write']:>7.1f}x   (target <= 1.5x)",
            f"{'NcclWeightSync.push over gloo (s)':<44}{r['gloo_push_s']:>12.4f}{r['push_s']:>12.4f}"
            f"{r['gloo_over_file']:>7.1f}x   (baseline: the file push above)",
            *(table_rows(r, load) if load.episodes else []),
        ]
    )


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench inference", description=__doc__, formatter_class=HelpFormatter
    )
    parser.add_argument(
        "--quick", action="store_true", help="small model and load (under a minute)"
    )
    parser.add_argument("--smoke", action="store_true", help="the smallest sizes (CI)")
    parser.add_argument("--json", action="store_true", help="print JSON (the table to stderr)")
    parser.add_argument("--threads", type=int, default=min(4, os.cpu_count() or 1))
    parser.add_argument(
        "--multi-turn-only", action="store_true", help="run only the multi-turn row"
    )
    parser.add_argument(
        "--kv-cache-mb", type=float, default=512.0, help="prefix cache budget (on side)"
    )
    parser.add_argument(
        "--model", type=Path, help="throughput only, on this model directory (16 x 32 tokens)"
    )
    parser.add_argument(
        "--multi-turn",
        action="store_true",
        help="with --model: the multi-turn row too, on that model (16 episodes x 8 turns, "
        "1024-token shared prompt)",
    )
    args = parser.parse_args(argv)
    run = report.start("inference", argv)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # one bar per weight push would bury the table
    if args.smoke:
        args.hidden, args.layers, args.concurrency, args.tokens, args.repeats = 64, 2, 4, 8, 1
        args.load = MultiTurn(episodes=2, turns=2, system_tokens=32, new_tokens=8, user_tokens=8)
    elif args.quick:
        args.hidden, args.layers, args.concurrency, args.tokens, args.repeats = 64, 2, 16, 32, 3
        args.load = MultiTurn(
            episodes=16, turns=4, system_tokens=256, new_tokens=32, user_tokens=16
        )
    else:
        args.hidden, args.layers, args.concurrency, args.tokens, args.repeats = 512, 12, 32, 64, 5
        args.load = MultiTurn(
            episodes=64, turns=8, system_tokens=1024, new_tokens=32, user_tokens=16
        )
    if args.model is not None and not args.smoke:
        args.concurrency, args.tokens, args.repeats = 16, 32, 3
        # a real model's cache-off side prefills ~1.3k tokens a call: 16 episodes, not 64
        args.load = MultiTurn(
            episodes=16, turns=8, system_tokens=1024, new_tokens=32, user_tokens=16
        )
    if args.model is not None:
        result = asyncio.run(_run_model(args))
    else:
        result = asyncio.run(_run(args))
    return report.emit(run, result, _table(result, args.load), args.json)
