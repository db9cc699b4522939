"""A latency-simulating inference server: a LOAD GENERATOR for benchmarks and tests, not a model.

Benchmark and test infrastructure (it lives in `bench/`, beside the benchmarks that
start it). It parses requests with the CPU policy server's own `/v1/completions`
subset (`inference.protocol.CompletionRequest`) and answers with the same response
builder (`inference.protocol.completion_response`), so its replies have exactly the
shape the real server sends and the `GenerationClient` accepts: token ids, legacy
logprobs, `weight_versions` spans. Each request sleeps a latency drawn from a
log-normal distribution, then returns random tokens (from `allowed_token_ids` when
given) ending with the first stop token; with `--mode code` it answers instead with a
```python block (the text the `code` environment extracts and runs) holding a passing,
a failing or a slow (passing after a sleep) solution, drawn by seeded weights. It lets the worker benchmark drive thousands
of episodes with no GPU, and measure the farm's own costs. `/health` and `/v1/models`
answer too.

CLI: `python -m bench._loadgen --port P [--median-ms 50] [--sigma 0.5] [--tokens 8]
[--mode random|code] [--slow-s 0.3]`.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import random
import sys
from typing import Any

from aiohttp import web

from broker.messages import Sampling
from inference.protocol import CompletionRequest, completion_response, error_body
from inference.sampling import SampleSpec
from inference.sequence import GenParams, GenRequest
from launch.settings import HelpFormatter

VOCAB = 256  # random tokens are bytes, which every tokenizer of the farm decodes
MODEL = "loadgen"
# Solutions of the built-in `sum-two` problem (the one the farm benchmark runs).
PASSING = "a, b = map(int, input().split())\nprint(a + b)\n"
FAILING = "a, b = map(int, input().split())\nprint(a - b)\n"
MIX = (("passing", 0.4), ("failing", 0.4), ("slow", 0.2))  # kind, weight


def code_answer(kind: str, slow_s: float) -> str:
    """A model answer in the format the `code` env extracts: one ```python block."""
    body = {"passing": PASSING, "failing": FAILING}.get(kind)
    if body is None:  # slow: right, but only after a sleep in every test run
        body = f"import time\ntime.sleep({slow_s})\n{PASSING}"
    return f"Here is my solution.\n```python\n{body}```"


class _NoText:
    """Stands in for a tokenizer: the load generator returns token ids, never text."""

    def decode(self, ids: Any, skip_special_tokens: bool = True) -> str:
        return ""


class LoadGenerator:
    """The request handler state: latency distribution and counters."""

    def __init__(
        self,
        median_ms: float,
        sigma: float,
        tokens: int,
        *,
        seed: int = 0,
        mode: str = "random",
        slow_s: float = 0.3,
    ) -> None:
        self.mode, self.slow_s = mode, slow_s
        self.answers = {kind: 0 for kind, _ in MIX}  # code answers sent, by kind
        self.mu = math.log(max(median_ms, 1e-3) / 1000.0)
        self.sigma = sigma
        self.tokens = tokens
        self.rng = random.Random(seed)
        self.requests = 0
        self.in_flight = 0
        self.peak_in_flight = 0  # most requests served at once, to check client pool limits

    async def completions(self, request: web.Request) -> web.Response:
        try:
            req = CompletionRequest.model_validate(await request.json())
        except ValueError as exc:
            return web.json_response(error_body(str(exc), 400), status=400)
        self.requests += 1
        self.in_flight += 1
        self.peak_in_flight = max(self.peak_in_flight, self.in_flight)
        try:
            await asyncio.sleep(self.rng.lognormvariate(self.mu, self.sigma))
        finally:
            self.in_flight -= 1
        gen = self._generate(req)
        return web.json_response(completion_response(req, gen, MODEL, _NoText()))

    def _generate(self, req: CompletionRequest) -> GenRequest:
        """One finished sequence of random tokens, ending with the first stop token."""
        stops = list(req.stop_token_ids or [])
        k = max(1, min(req.max_tokens, self.tokens))
        allowed = req.allowed_token_ids
        pool = [t for t in allowed if t not in stops] if allowed else None
        ids = [self.rng.choice(pool) if pool else self.rng.randrange(VOCAB) for _ in range(k - 1)]
        if self.mode == "code":  # byte-level ids: every farm tokenizer's id == byte
            kind = self.rng.choices([m for m, _ in MIX], [w for _, w in MIX])[0]
            self.answers[kind] += 1
            text = code_answer(kind, self.slow_s).encode()
            k = min(req.max_tokens, len(text) + 1)
            ids = list(text[: k - 1])
        ids.append(stops[0] if stops else self.rng.randrange(VOCAB))
        spec = SampleSpec(Sampling(), req.logprobs or 0)
        params = GenParams(1, k, spec, None, frozenset(stops), req.ignore_eos)
        gen = GenRequest(list(req.prompt), params)
        seq = gen.seqs[0]
        seq.tokens, seq.logprobs = ids, [-1.0] * len(ids)
        seq.tops, seq.versions = [[] for _ in ids], ["0"] * len(ids)
        seq.finish_reason = "stop" if stops else "length"
        seq.stop_reason = stops[0] if stops else None
        return gen

    async def health(self, _: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def models(self, _: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": MODEL, "object": "model"}]})


def build_app(gen: LoadGenerator) -> web.Application:
    app = web.Application()
    app.router.add_post("/v1/completions", gen.completions)
    app.router.add_get("/health", gen.health)
    app.router.add_get("/v1/models", gen.models)
    return app


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench._loadgen", description=__doc__, formatter_class=HelpFormatter
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--median-ms", type=float, default=50.0, help="median latency")
    parser.add_argument("--sigma", type=float, default=0.5, help="log-normal sigma of latency")
    parser.add_argument("--tokens", type=int, default=8, help="tokens per completion")
    parser.add_argument(
        "--mode",
        choices=("random", "code"),
        default="random",
        help="random tokens, or code answers for the `code` env (sum-two)",
    )
    parser.add_argument("--slow-s", type=float, default=0.3, help="sleep of slow solutions")
    args = parser.parse_args(argv)
    gen = LoadGenerator(args.median_ms, args.sigma, args.tokens, mode=args.mode, slow_s=args.slow_s)
    web.run_app(build_app(gen), host=args.host, port=args.port, print=None, backlog=4096)
    return 0


if __name__ == "__main__":
    sys.exit(main())
