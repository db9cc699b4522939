"""The farm's loop in one process, synchronous and on-policy: for learning-dynamics tests.

`train(...)` runs the workers' own episode code (`workers.group.run_group`, the codec, the
environment's action vocabulary) against `ModelGenerator`, which samples from the learner's
live model exactly as the CPU server does (`inference.sampling.sample_rows`: the processed
distribution, the episode's sampling seeds), then the learner's own `Core.train` (batch
preparation, the critic, the schedules, the trainer). No HTTP, Redis or weight push: what it
measures is the learning rule on the farm's data path, in seconds instead of minutes. The
through-the-farm tests (test_e2e.py) check that the distributed loop learns the same.

`FARM_TEST_DEVICE` (default ``cpu``) names the device the learner trains and the generator
samples on, so that the same learning claims run on a GPU node (``FARM_TEST_DEVICE=cuda``:
the learner's bf16 autocast, under which the generator samples too, and the fused optimizer).
The sampling draw stays on the CPU, with the episode's seeded CPU generators.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path

import torch

from broker.messages import Task, TrajectoryGroup
from inference.client import Generation, SamplingParams
from inference.decode_batch import cache_kwarg
from inference.sampling import SampleSpec, sample_rows
from learner.config import LearnerConfig
from learner.core import Core, build_core
from learner.distributed import DistContext
from learner.trainer import StepStats
from workers.config import EpisodeSettings
from workers.episode import EpisodeContext
from workers.group import run_group
from workers.tokens import load_codec


def inprocess_device() -> torch.device:
    """The device in-process runs use: `FARM_TEST_DEVICE`, else the CPU."""
    return torch.device(os.environ.get("FARM_TEST_DEVICE", "cpu"))


# event-loop turns a batch waits, so that every episode of a gather has queued its request
_SETTLE_TURNS = 20


@dataclass
class _Request:
    prompt: list[int]
    params: SamplingParams
    done: asyncio.Future[Generation]


class ModelGenerator:
    """Token-in, token-out generation from an in-process model.

    Requests made in the same turn of the event loop (the episodes of one `asyncio.gather`) are
    decoded as one left-padded batch with a KV cache, as the CPU server batches them: a
    pretrained model's step would otherwise be one full forward per token per episode. Each
    row keeps its own seeded generator, so a row samples what it would sample alone.

    ``lean=True`` prefills the batch's common prompt prefix once (a shared system prompt and
    worked examples: ~350 of calc's ~375 tokens, 47 s of a 30-row prefill on one thread) and
    drops finished rows from the batch, as the CPU server's prefix cache and running batch do.
    Both change the order of floating-point sums, so a seeded run samples other (equally
    valid) trajectories than on the plain path; the tiny-model learning tests keep the plain
    path their seeded margins were measured on.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        precision: Callable[[], AbstractContextManager[object]] = contextlib.nullcontext,
        *,
        lean: bool = False,
    ) -> None:
        self.model = model
        self.precision = precision  # the learner's autocast, so that mu and pi share numerics
        self.lean = lean
        self.version = 0
        self._pending: list[_Request] = []
        self._batch: asyncio.Task[None] | None = None
        self._cache_arg = cache_kwarg(model)

    async def generate(
        self, prompt_ids: Sequence[int], params: SamplingParams, *, session_id: str
    ) -> Generation:
        request = _Request(list(prompt_ids), params, asyncio.get_running_loop().create_future())
        self._pending.append(request)
        if self._batch is None:
            self._batch = asyncio.create_task(self._run_batch(), name="in-process-batch")
        return await request.done

    async def _run_batch(self) -> None:
        for _ in range(_SETTLE_TURNS):  # let every episode of the gather reach generate()
            await asyncio.sleep(0)
        batch, self._pending, self._batch = self._pending, [], None
        try:
            results = self._decode(batch)
        except Exception as exc:  # every waiting episode gets the failure, none hangs
            for request in batch:
                request.done.set_exception(exc)
            return
        for request, result in zip(batch, results, strict=True):
            request.done.set_result(result)

    def _decode(self, batch: list[_Request]) -> list[Generation]:
        from transformers import DynamicCache

        cache = DynamicCache(config=self.model.config)
        shared = self._prefill_shared(batch, cache) if self.lean else 0
        width = max(len(r.prompt) for r in batch) - shared
        feed = torch.zeros((len(batch), width), dtype=torch.long)
        mask = torch.zeros((len(batch), shared + width), dtype=torch.long)
        mask[:, :shared] = 1
        for i, r in enumerate(batch):
            suffix = r.prompt[shared:]  # left-padded after the shared prefix
            feed[i, width - len(suffix) :] = torch.tensor(suffix)
            mask[i, shared + width - len(suffix) :] = 1
        gens = [
            None if r.params.seed is None else torch.Generator().manual_seed(r.params.seed)
            for r in batch
        ]
        specs = [SampleSpec(r.params.distribution(), 0) for r in batch]
        rows: list[tuple[list[int], list[float]]] = [([], []) for _ in batch]
        finish = ["length"] * len(batch)
        live = [r.params.max_tokens > 0 for r in batch]
        batched = list(range(len(batch)))  # the request behind each row of the cache
        while any(live):
            logits = self._forward(feed, mask, cache)
            tokens, logprobs, _ = sample_rows(
                logits, [specs[i] for i in batched], [gens[i] for i in batched]
            )
            for i, token, logprob in zip(batched, tokens, logprobs, strict=True):
                if not live[i]:
                    continue
                rows[i][0].append(token)
                rows[i][1].append(logprob)
                if token in batch[i].params.stop_token_ids:
                    finish[i], live[i] = "stop", False
                elif len(rows[i][0]) >= batch[i].params.max_tokens:
                    live[i] = False
            feed = torch.tensor(tokens)[:, None]
            mask = torch.cat([mask, torch.ones((len(batched), 1), dtype=torch.long)], dim=1)
            keep = [j for j, i in enumerate(batched) if live[i]]
            if self.lean and keep and len(keep) < len(batched):
                cache.batch_select_indices(torch.tensor(keep))
                feed, mask = feed[keep], mask[keep]
                batched = [batched[j] for j in keep]
        return [
            Generation(t, lp, [self.version] * len(t), f, "in-process")
            for (t, lp), f in zip(rows, finish, strict=True)
        ]

    def _prefill_shared(self, batch: list[_Request], cache: object) -> int:
        """Put the KV of the batch's common prompt prefix in `cache`, once for every row; its
        length (each row keeps at least one token of its own to prefill, for its logits)."""
        first, shared = batch[0].prompt, min(len(r.prompt) for r in batch) - 1
        for r in batch[1:]:
            shared = next((j for j in range(shared) if r.prompt[j] != first[j]), shared)
        if len(batch) < 2 or shared < 1:
            return 0
        self._forward(
            torch.tensor([first[:shared]]), torch.ones((1, shared), dtype=torch.long), cache
        )
        cache.batch_repeat_interleave(len(batch))  # type: ignore[attr-defined]
        return shared

    def _forward(self, feed: torch.Tensor, mask: torch.Tensor, cache: object) -> torch.Tensor:
        """One forward pass of `feed` onto `cache` (`mask` covers both); last-position logits."""
        device = next(self.model.parameters()).device
        positions = (mask.cumsum(-1) - 1).clamp(min=0)[:, -feed.shape[1] :]
        with torch.no_grad(), self.precision():
            out = self.model(
                input_ids=feed.to(device),
                attention_mask=mask.to(device),
                position_ids=positions.to(device),
                use_cache=True,
                logits_to_keep=1,
                **{self._cache_arg: cache},
            )
        return out.logits[:, -1].float().cpu()

    def end_session(self, session_id: str) -> None:
        """No sticky servers here."""


@dataclass
class Run:
    """What a run produced: each step's mean reward and statistics, and the learner's core."""

    rewards: list[float] = field(default_factory=list)
    stats: list[StepStats] = field(default_factory=list)
    core: Core | None = None


def train(  # noqa: PLR0913
    model_dir: Path,
    env_spec: str,
    *,
    steps: int,
    seed: int,
    groups: int = 4,
    group_size: int = 8,
    flags: dict[str, object] | None = None,
    settings: EpisodeSettings | None = None,
    push: bool = True,
    threads: int | None = 1,
    until: float | None = None,
    lean: bool = False,
) -> Run:
    """`steps` synchronous steps of `groups` x `group_size` episodes of `env_spec`, trained by
    the learner's own `Core` (batch preparation, critic, schedules) built from `flags`, the
    learner's command-line settings.

    ``push=False`` is the control: episodes keep sampling the initial weights (a frozen copy)
    while the learner trains, as a farm whose weights never reach the servers.

    `threads` defaults to one: a seeded run is then the same run on any machine (a reduction
    split across threads rounds differently and the trajectories part), and the tiny model is
    no faster on two (200 lookup steps took 209 s on two threads, ~150 s on one). None keeps
    torch's setting, for a pretrained model that needs every core.

    `until` ends the run early at the first 10-step window whose mean reward reaches it; the
    steps before are the same as in the full run. `lean`: `ModelGenerator`'s.
    """
    with torch_threads(threads):
        return _train(
            model_dir,
            env_spec,
            steps=steps,
            seed=seed,
            groups=groups,
            group_size=group_size,
            flags=flags,
            settings=settings,
            push=push,
            until=until,
            lean=lean,
        )


@contextlib.contextmanager
def torch_threads(threads: int | None) -> Iterator[None]:
    """torch's intra-op threads set to `threads` (None: left as they are) for the block."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads or before)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _train(  # noqa: PLR0913
    model_dir: Path,
    env_spec: str,
    *,
    steps: int,
    seed: int,
    groups: int,
    group_size: int,
    flags: dict[str, object] | None,
    settings: EpisodeSettings | None,
    push: bool,
    until: float | None,
    lean: bool,
) -> Run:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    cfg = LearnerConfig.load(
        {
            "model": model_dir,
            "group_size": group_size,
            "groups_per_batch": groups,
            "max_steps": steps,
            **(flags or {}),
        },
        environ={},
    )
    device = inprocess_device()
    core = build_core(cfg, DistContext(), device)
    model = core.trainer.model
    sampler = model if push else AutoModelForCausalLM.from_pretrained(model_dir).eval().to(device)
    generator = ModelGenerator(sampler, core.trainer.autocast, lean=lean)
    ctx = EpisodeContext(load_codec(str(model_dir)), generator, SamplingParams)
    episode = settings or EpisodeSettings(max_tokens=1, temperature=1.0)
    rng = random.Random(seed)
    run = Run(core=core)
    for step in range(steps):
        tasks = [
            Task(f"s{step}-g{g}", env_spec, group_size, rng.randrange(2**31), step)
            for g in range(groups)
        ]
        batch = asyncio.run(_groups(ctx, episode, tasks))
        prepared, stats = core.train(batch, replay=False)
        run.rewards.append(sum(prepared.episode_returns) / max(len(prepared.episode_returns), 1))
        if stats is not None:
            run.stats.append(stats)
        generator.version = core.state.step if push else 0
        if until is not None and window_mean(run.rewards)[-1:] >= [until]:
            break
    return run


async def _groups(
    ctx: EpisodeContext, cfg: EpisodeSettings, tasks: list[Task]
) -> list[TrajectoryGroup]:
    return list(
        await asyncio.gather(
            *(run_group(ctx, cfg, t, max_turns=8, retries=0, worker_id="in-process") for t in tasks)
        )
    )


def window_mean(rewards: Sequence[float], window: int = 10) -> list[float]:
    """The mean of each run of `window` consecutive steps."""
    return [sum(rewards[i - window : i]) / window for i in range(window, len(rewards) + 1)]


@dataclass(frozen=True)
class Score:
    """A policy's score on a set of prompts: mean reward over every sample, pass@k (the
    share of prompts with at least one sample that scored 1), and the share of episodes
    that went past their first turn (in a tool environment whose turn without a call ends
    the episode, the tool-call rate; `learner.evalscore`'s ``multi_turn``)."""

    mean: float
    pass_at_k: float
    past_turn_1: float = 0.0


def evaluate(
    model: torch.nn.Module,
    model_dir: Path,
    lines: Sequence[str],
    *,
    k: int,
    settings: EpisodeSettings,
    threads: int | None = None,
    lean: bool = False,
) -> Score:
    """`k` samples of each task line's problem (``{"env_spec": ..., "row": ...}``, the
    learner's eval-set format: each row its own problem, seeded by its index) from `model`,
    through the workers' episode code, on `threads` torch threads (None: as they are)."""
    generator = ModelGenerator(model, lean=lean)
    ctx = EpisodeContext(load_codec(str(model_dir)), generator, SamplingParams)
    rows = [json.loads(line) for line in lines]
    tasks = [
        Task(f"eval-{i}", r["env_spec"], k, i, 0, row=r.get("row")) for i, r in enumerate(rows)
    ]
    with torch_threads(threads):
        groups = asyncio.run(_groups(ctx, settings, tasks))
    returns = [[sum(t.reward for t in tr.turns) for tr in g.trajectories] for g in groups]
    episodes = [tr for g in groups for tr in g.trajectories]
    return Score(
        mean=sum(map(sum, returns)) / sum(map(len, returns)),
        pass_at_k=sum(max(r) >= 1.0 for r in returns) / len(returns),
        past_turn_1=sum(len(tr.turns) > 1 for tr in episodes) / len(episodes),
    )


def before_and_after(
    model_dir: Path,
    env_spec: str,
    heldout: Sequence[str],
    *,
    steps: int,
    seed: int,
    k: int,
    flags: dict[str, object],
    settings: EpisodeSettings,
) -> tuple[Score, Score, list[float]]:
    """The held-out score (`heldout`: task lines, `k` samples each) of the pretrained model in
    `model_dir`, then after `steps` steps of 4 x 8 episodes of `env_spec` at `seed`, all on one
    thread, on `ModelGenerator`'s lean path; and each step's mean reward."""
    from transformers import AutoModelForCausalLM

    def score(model: torch.nn.Module) -> Score:
        return evaluate(model, model_dir, heldout, k=k, settings=settings, threads=1, lean=True)

    base = score(AutoModelForCausalLM.from_pretrained(model_dir).eval())
    run = train(
        model_dir,
        env_spec,
        steps=steps,
        seed=seed,
        groups=4,
        group_size=8,
        flags=flags,
        settings=settings,
        threads=1,
        lean=True,
    )
    assert run.core is not None
    return base, score(run.core.trainer.model.eval()), run.rewards
