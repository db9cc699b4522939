"""`python -m bench._step_profile [--rounds N] [--episodes N]`: where the farm's CPU per env
step goes, in the setting of `python -m bench workers`' CPU phase (uvloop, 256 lanes, the
bench's loadgen at 5 ms, the instant `bench-sim` env, the tiny model's codec).

Three parts, each measured rather than profiled (cProfile inflates Python-heavy code by
~0.5 µs a call, and a step makes ~240 calls):

1. Whole paths, interleaved in rounds in one process, user and system CPU from getrusage
   per step: the farm step; the episode loop alone (`InstantGenerator`: no HTTP, never
   yields); the same loop yielding once per step (`asyncio.sleep(0)`: 256 episodes
   interleave as they do around a real generate); `GenerationClient.generate` alone on a
   prompt of the bench's mean length; a bare `inference.http` request with the same body.
   Their differences split the step: loop, scheduling, client layer, transport.
2. Pieces of the episode loop in place: the loop-only run with one piece replaced by a
   precomputed result; the drop is the piece's cost as it runs there (cache misses
   included, which a piece timed alone in a hot loop does not pay).
3. Pieces of the client timed alone (timeit) at the bench's sizes.

Medians over rounds, and over the quietest third of rounds for the drops (with the cyclic
collector off there: its bursts land in any round; its own cost is timed with gc.callbacks on
the whole paths): this 2-core machine is shared, and a round beside another process's burst
costs up to 1.7x.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import resource
import statistics
import time
import timeit
import types
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import httptools
import orjson

import envs
from bench import workers as W
from bench._loadgen_proc import serving
from broker.messages import Task
from inference import http as lean_http
from inference.client import Generation, SamplingParams, _check_choice, expand_versions
from workers import episode
from workers.answers import Answer, AnswerReader
from workers.resources import loop_factory, tune_gc
from workers.transcript import Transcript

SPEC = 'bench-sim@{"env_ms": 0, "alpha": 1.3, "cap": 16}'
LANES = 256


class _GcClock:
    """CPU time spent in the cyclic collector, from gc.callbacks."""

    def __init__(self) -> None:
        self.total, self._start = 0.0, 0.0
        gc.callbacks.append(self._on)

    def _on(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._start = time.process_time()
        else:
            self.total += time.process_time() - self._start


GC = _GcClock()


def _cpu() -> tuple[float, float]:
    use = resource.getrusage(resource.RUSAGE_SELF)
    return use.ru_utime, use.ru_stime


async def _timed(run: Awaitable[int], into: list[tuple[float, float, float]]) -> None:
    u0, s0, g0 = *_cpu(), GC.total
    steps = await run
    u1, s1, g1 = *_cpu(), GC.total
    into.append(((u1 - u0) / steps * 1e6, (s1 - s0) / steps * 1e6, (g1 - g0) / steps * 1e6))


async def _lanes(n: int, one: Callable[[int], Awaitable[Any]]) -> int:
    pending = iter(range(n))

    async def lane() -> None:
        for i in pending:
            await one(i)

    async with asyncio.TaskGroup() as tg:
        for k in range(LANES):
            tg.create_task(lane(), name=f"lane:{k}")
    return n


class _Yielding(W.InstantGenerator):
    """The instant generator, yielding to the event loop once per call as a real one does."""

    async def generate(self, prompt_ids: Any, params: Any, *, session_id: str) -> Any:
        await asyncio.sleep(0)
        return await super().generate(prompt_ids, params, session_id=session_id)


class _Lengths:
    """Wraps a generator and records each prompt's length."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.lengths = inner, []

    async def generate(self, prompt_ids: Any, params: Any, *, session_id: str) -> Any:
        self.lengths.append(len(prompt_ids))
        return await self.inner.generate(prompt_ids, params, session_id=session_id)

    def end_session(self, session_id: str) -> None:
        self.inner.end_session(session_id)


class _Nop:
    def inc(self, *_: Any) -> None: ...
    def dec(self, *_: Any) -> None: ...
    def observe(self, *_: Any) -> None: ...


def _loop_pieces(codec: Any) -> dict[str, list[tuple[Any, str, Any]]]:
    """Each piece of the episode loop and the patches that replace it by a precomputed result."""
    nop = _Nop()
    no_metrics = types.SimpleNamespace(
        EPISODES_IN_FLIGHT=nop,
        ERRORS=nop,
        INFERENCE_LATENCY=nop,
        TOKENS_GENERATED=nop,
        ENV_STEP_SECONDS=nop,
        SANDBOX_SECONDS=nop,
        env_steps=lambda env: nop,
        episodes=lambda env, outcome: nop,
        observe_reward_components=lambda *_: None,
    )
    after = codec.next_prompt([1, 2, 3, codec.stop_token_ids[0]], "Observation 3.")
    first = codec.initial_prompt("Episode 1: begin.", None, None)
    answer = Answer("Hello!!", 0)

    def next_(self: Transcript, completion: Any, text: str, obs: Any) -> tuple[list[int], bool]:
        self.context.extend(completion)
        self.context.extend(after)
        return after, False

    def first_(self: Transcript, obs: Any) -> list[int]:
        self.context = list(first)
        return first

    async def astep(env: Any, action: Any) -> Any:
        return await env.astep(action)

    async def areset(env: Any, seed: int | None = None, options: Any = None) -> Any:
        return await env.areset(seed=seed)

    direct = types.SimpleNamespace(
        make=envs.make,
        areset=areset,
        astep=astep,
        aclose=envs.aclose,
        EnvSpecError=envs.EnvSpecError,
    )

    class LightTurn:
        def __init__(self, **fields: Any) -> None:
            self.fields = fields

    return {
        "transcript.next (tail, observation encode, joins)": [(Transcript, "next", next_)],
        "transcript.first (first prompt; per episode)": [(Transcript, "first", first_)],
        "answer read (decode of the completion)": [
            (AnswerReader, "read", lambda self, ids, thinking=None: answer)
        ],
        "Turn(...) (three numpy arrays, frozen init)": [(episode, "Turn", LightTurn)],
        "metrics (prometheus: 2 observes, 2 incs)": [(episode, "metrics", no_metrics)],
        "sampling seed (blake2b)": [(Task, "sampling_seed", lambda self, index, turn: 7)],
        "dataclasses.replace of the sampling params": [
            (episode, "dataclasses", types.SimpleNamespace(replace=lambda p, **_: p))
        ],
        "envs.areset/astep wrappers (not the env)": [(episode, "envs", direct)],
    }


@contextlib.contextmanager
def _patched(patches: list[tuple[Any, str, Any]]) -> Iterator[None]:
    saved = [(obj, name, getattr(obj, name)) for obj, name, _ in patches]
    for obj, name, value in patches:
        setattr(obj, name, value)
    try:
        yield
    finally:
        for obj, name, value in saved:
            setattr(obj, name, value)


def _client_pieces(client: Any, url: str, prompt: list[int], reply: bytes) -> dict[str, float]:
    """The Python pieces of one generate, each timed alone (µs)."""
    params = SamplingParams(max_tokens=8, stop_token_ids=(258, 256), seed=12345)
    body = orjson.dumps(client._body(prompt, params, 8))
    server = client._servers[url]
    _, payload = reply.split(b"\r\n\r\n", 1)
    choice = _check_choice(orjson.loads(payload))
    http = client._http
    loop = asyncio.get_running_loop()

    class Sink:
        def on_body(self, body: bytes) -> None: ...
        def on_message_complete(self) -> None: ...

    pieces: dict[str, Callable[[], Any]] = {
        "routing: _pick (sticky) + _pin": lambda: (
            client._pin("s1", url),
            client._pick("s1", set()),
        ),
        "request dict (_body)": lambda: client._body(prompt, params, 8),
        f"orjson.dumps ({len(prompt)} prompt ids)": lambda: orjson.dumps(
            client._body(prompt, params, 8), option=orjson.OPT_SERIALIZE_NUMPY
        ),
        "request bytes (cached head + length + body)": lambda: (
            http._target("POST", server.completions)[1] + b"%d\r\n\r\n" % len(body) + body
        ),
        "httptools parse of the reply": lambda: httptools.HttpResponseParser(Sink()).feed_data(
            reply
        ),
        "orjson.loads + _check_choice": lambda: _check_choice(orjson.loads(payload)),
        "expand_versions + token lists + Generation": lambda: Generation(
            [*choice["token_ids"]],
            [*choice["logprobs"]["token_logprobs"]],
            expand_versions(choice["weight_versions"], len(choice["token_ids"])),
            "stop",
            url,
        ),
        "metrics (latency observe, requests inc)": lambda: (
            server.latency.observe(0.005),
            server.requests["ok"].inc(),
        ),
        "request timer (call_at + cancel)": lambda: loop.call_at(loop.time() + 99, print).cancel(),
        "reply future (create + set_result)": lambda: loop.create_future().set_result(1),
    }
    return {
        name: statistics.median(timeit.repeat(f, number=20_000, repeat=5)) / 20_000 * 1e6
        for name, f in pieces.items()
    }


async def _capture_reply(url: str, body: bytes) -> bytes:
    """One reply's bytes as they arrive (a fresh client: uvloop binds data_received)."""
    chunks: list[bytes] = []
    original = lean_http._Connection.data_received

    def record(self: Any, data: bytes) -> None:
        chunks.append(data)
        original(self, data)

    lean_http._Connection.data_received = record  # type: ignore[method-assign]
    try:
        fresh = lean_http.HttpClient(limit=1, connect_timeout_s=5)
        await fresh.request("POST", url + "/v1/completions", body, 10.0)
        await fresh.close()
    finally:
        lean_http._Connection.data_received = original  # type: ignore[method-assign]
    replies = [c for c in chunks if b'"choices"' in c]  # not a health check's reply
    assert len(replies) == 1 and replies[0].startswith(b"HTTP/1.1 200"), chunks
    return replies[0]


async def profile(rounds: int, episodes: int) -> dict[str, Any]:
    paths = ("farm step", "loop alone", "loop, yielding", "generate alone", "bare lean request")
    whole: dict[str, list[tuple[float, float, float]]] = {k: [] for k in paths}
    async with serving(None, *W.CPU_LOADGEN) as url, W.farm_context(url) as ctx:
        stop = ctx.codec.stop_token_ids[0]
        alone = W.EpisodeContext(ctx.codec, W.InstantGenerator(stop), ctx.sampling)
        yielding = W.EpisodeContext(ctx.codec, _Yielding(stop), ctx.sampling)
        lengths = _Lengths(ctx.client)
        recorded = W.EpisodeContext(ctx.codec, lengths, ctx.sampling)
        seeds = list(range(1000, 1000 + episodes))
        steps = await W.run_async(recorded, SPEC, seeds, LANES)  # warm-up, and the prompt sizes
        mean_prompt = round(statistics.mean(lengths.lengths))
        prompt = list(range(40, 40 + mean_prompt))
        params = SamplingParams(max_tokens=8, stop_token_ids=tuple(ctx.codec.stop_token_ids))
        client = ctx.client
        body = orjson.dumps(client._body(prompt, params, 8))
        target = url + "/v1/completions"
        pieces = _loop_pieces(ctx.codec)
        drops: dict[str, list[float]] = {k: [] for k in ("base", *pieces)}
        for _ in range(rounds):
            await _timed(W.run_async(ctx, SPEC, seeds, LANES), whole["farm step"])
            await _timed(W.run_async(alone, SPEC, seeds, LANES), whole["loop alone"])
            await _timed(W.run_async(yielding, SPEC, seeds, LANES), whole["loop, yielding"])

            def generate(i: int) -> Awaitable[Generation]:
                return client.generate(prompt, params, session_id=f"s{i}")

            def bare(i: int) -> Awaitable[Any]:
                return client._http.request("POST", target, body, 120.0)

            await _timed(_lanes(steps, generate), whole["generate alone"])
            await _timed(_lanes(steps, bare), whole["bare lean request"])
            gc.disable()  # the collector's bursts land in any round; it is its own row
            for name, patches in {"base": [], **pieces}.items():
                with _patched(patches):
                    c0 = time.process_time()
                    n = await W.run_async(alone, SPEC, seeds, LANES)
                    drops[name].append((time.process_time() - c0) / n * 1e6)
            gc.enable()
        reply = await _capture_reply(url, body)
        alone_pieces = _client_pieces(client, url, prompt, reply)

    def quiet_third(xs: list[float]) -> float:
        return statistics.median(sorted(xs)[: max(1, len(xs) // 3)])

    base = quiet_third(drops["base"])
    return {
        "rounds": rounds,
        "steps_per_round": steps,
        "turns_per_episode": steps / episodes,
        "mean_prompt_tokens": mean_prompt,
        "request_bytes": len(body),
        "reply_bytes": len(reply),
        "paths_us": {
            k: {
                "user": statistics.median(u for u, _, _ in v),
                "sys": statistics.median(s for _, s, _ in v),
                "total": statistics.median(u + s for u, s, _ in v),
                "gc_mean": statistics.mean(g for _, _, g in v),  # bursts: a mean, not a median
                "rounds": [round(u + s) for u, s, _ in v],
            }
            for k, v in whole.items()
        },
        "loop_pieces_us": {"base (quietest third, collector off)": base}
        | {k: base - quiet_third(v) for k, v in drops.items() if k != "base"},
        "client_pieces_alone_us": alone_pieces,
    }


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m bench._step_profile", description=__doc__)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--episodes", type=int, default=300, help="per round and path")
    args = parser.parse_args()
    tune_gc()
    with asyncio.Runner(loop_factory=loop_factory("uvloop")) as runner:
        out = runner.run(profile(args.rounds, args.episodes))
    print(orjson.dumps(out, option=orjson.OPT_INDENT_2).decode())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
