"""A latency-simulating inference server: a LOAD GENERATOR for benchmarks, not a model.

It speaks the `/v1/completions` token-in/token-out shape of vLLM and of the CPU policy
server (`return_token_ids`, legacy logprobs with `return_tokens_as_token_ids`,
`weight_versions` spans), plus `/health` and `/v1/models`. Each request sleeps a
latency drawn from a log-normal distribution, then returns random tokens (from
`allowed_token_ids` when given) ending with the first stop token. It lets the worker
benchmark drive thousands of episodes with no GPU, and measure the farm's own costs.

CLI: `python -m workers.loadgen --port P [--median-ms 50] [--sigma 0.5] [--tokens 8]`.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import random
import sys
import time

from aiohttp import web

VOCAB = 256  # random tokens are bytes, which every tokenizer of the farm decodes


class LoadGenerator:
    """The request handler state: latency distribution and counters."""

    def __init__(self, median_ms: float, sigma: float, tokens: int, seed: int = 0) -> None:
        self.mu = math.log(max(median_ms, 1e-3) / 1000.0)
        self.sigma = sigma
        self.tokens = tokens
        self.rng = random.Random(seed)
        self.requests = 0
        self.in_flight = 0
        self.peak_in_flight = 0  # most requests served at once, to check client pool limits

    async def completions(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.requests += 1
        self.in_flight += 1
        self.peak_in_flight = max(self.peak_in_flight, self.in_flight)
        try:
            await asyncio.sleep(self.rng.lognormvariate(self.mu, self.sigma))
        finally:
            self.in_flight -= 1
        allowed = body.get("allowed_token_ids") or None
        stops = body.get("stop_token_ids") or []
        k = max(1, min(int(body.get("max_tokens", 16)), self.tokens))
        pool = [t for t in allowed if t not in stops] if allowed else None
        ids = [self.rng.choice(pool) if pool else self.rng.randrange(VOCAB) for _ in range(k - 1)]
        finish = "length"
        if stops:
            ids.append(stops[0])
            finish = "stop"
        elif k:
            ids.append(self.rng.randrange(VOCAB))
        choice = {
            "index": 0,
            "text": "",
            "finish_reason": finish,
            "stop_reason": stops[0] if stops else None,
            "token_ids": ids,
            "prompt_token_ids": None,
            "logprobs": {
                "tokens": [f"token_id:{t}" for t in ids],
                "token_logprobs": [-1.0] * len(ids),
                "top_logprobs": None,
                "text_offset": [0] * len(ids),
            },
            "weight_versions": [{"version": "0", "start": 0, "end": len(ids)}],
        }
        return web.json_response(
            {
                "id": f"cmpl-{self.requests}",
                "object": "text_completion",
                "created": int(time.time()),
                "model": "loadgen",
                "choices": [choice],
                "usage": {"prompt_tokens": len(body.get("prompt", [])), "completion_tokens": k},
            }
        )

    async def health(self, _: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def models(self, _: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "loadgen", "object": "model"}]})


def build_app(gen: LoadGenerator) -> web.Application:
    app = web.Application()
    app.router.add_post("/v1/completions", gen.completions)
    app.router.add_get("/health", gen.health)
    app.router.add_get("/v1/models", gen.models)
    return app


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m workers.loadgen", description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--median-ms", type=float, default=50.0, help="median latency")
    parser.add_argument("--sigma", type=float, default=0.5, help="log-normal sigma of latency")
    parser.add_argument("--tokens", type=int, default=8, help="tokens per completion")
    args = parser.parse_args(argv)
    gen = LoadGenerator(args.median_ms, args.sigma, args.tokens)
    web.run_app(build_app(gen), host=args.host, port=args.port, print=None, backlog=4096)
    return 0


if __name__ == "__main__":
    sys.exit(main())
