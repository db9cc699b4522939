"""The farm's loop in one process, synchronous and on-policy: for learning-dynamics tests.

`train(...)` runs the workers' own episode code (`workers.group.run_group`, the codec, the
environment's action vocabulary) against `ModelGenerator`, which samples from the learner's
live model exactly as the CPU server does (`inference.sampling.sample_rows`: the processed
distribution, the episode's sampling seeds), then the learner's own `Core.train` (batch
preparation, the critic, the schedules, the trainer). No HTTP, Redis or weight push: what it
measures is the learning rule on the farm's data path, in seconds instead of minutes. The
through-the-farm tests (test_e2e.py) check that the distributed loop learns the same.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from broker.messages import Task, TrajectoryGroup
from inference.client import Generation, SamplingParams
from inference.sampling import SampleSpec, sample_rows
from learner.config import LearnerConfig
from learner.core import Core, build_core
from learner.distributed import DistContext
from learner.trainer import StepStats
from workers.config import EpisodeSettings
from workers.episode import EpisodeContext
from workers.group import run_group
from workers.tokens import load_codec


class ModelGenerator:
    """Token-in, token-out generation from an in-process model.

    The episodes of a step call `generate` concurrently; the calls that are waiting for their
    next token are decoded in one padded forward (right padding: under the causal mask a pad
    after a row's last token cannot change its logits) and sampled together, each row with
    its own seeded generator, as the CPU server does.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.version = 0
        self._waiting: list[
            tuple[list[int], SampleSpec, torch.Generator | None, asyncio.Future]
        ] = []

    async def generate(
        self, prompt_ids: Sequence[int], params: SamplingParams, *, session_id: str
    ) -> Generation:
        ids, tokens, logprobs = list(prompt_ids), [], []
        gen = None if params.seed is None else torch.Generator().manual_seed(params.seed)
        spec = SampleSpec(params.distribution(), 0)
        finish = "length"
        for _ in range(params.max_tokens):
            token, logprob = await self._next_token(ids, spec, gen)
            ids.append(token)
            tokens.append(token)
            logprobs.append(logprob)
            if token in params.stop_token_ids:
                finish = "stop"
                break
        return Generation(tokens, logprobs, [self.version] * len(tokens), finish, "in-process")

    def _next_token(
        self, ids: list[int], spec: SampleSpec, gen: torch.Generator | None
    ) -> asyncio.Future:
        loop = asyncio.get_running_loop()
        if not self._waiting:
            loop.call_soon(self._decode)  # after every episode that is ready has queued
        future = loop.create_future()
        self._waiting.append((ids, spec, gen, future))
        return future

    def _decode(self) -> None:
        waiting, self._waiting = self._waiting, []
        lengths = [len(ids) for ids, *_ in waiting]
        batch = torch.zeros(len(waiting), max(lengths), dtype=torch.long)
        for row, (ids, *_) in enumerate(waiting):
            batch[row, : len(ids)] = torch.tensor(ids)
        with torch.no_grad():
            logits = self.model(batch).logits
        last = logits[torch.arange(len(waiting)), torch.tensor(lengths) - 1]
        tokens, logprobs, _ = sample_rows(last, [w[1] for w in waiting], [w[2] for w in waiting])
        for (*_, future), token, logprob in zip(waiting, tokens, logprobs, strict=True):
            future.set_result((token, logprob))

    def end_session(self, session_id: str) -> None:
        """No sticky servers here."""


@dataclass
class Run:
    """What a run produced: each step's mean reward and statistics, and the learner's core."""

    rewards: list[float] = field(default_factory=list)
    stats: list[StepStats] = field(default_factory=list)
    core: Core | None = None


def train(model_dir: Path, env_spec: str, *, steps: int, seed: int, groups: int = 4,
          group_size: int = 8, flags: dict[str, object] | None = None,
          settings: EpisodeSettings | None = None, push: bool = True) -> Run:  # fmt: skip
    """`steps` synchronous steps of `groups` x `group_size` episodes of `env_spec`, trained by
    the learner's own `Core` (batch preparation, critic, schedules) built from `flags`, the
    learner's command-line settings.

    ``push=False`` is the control: episodes keep sampling the initial weights (a frozen copy)
    while the learner trains, as a farm whose weights never reach the servers.
    """

    # One thread: a seeded run is then the same run on any machine (a reduction split across
    # threads rounds differently and the trajectories part), and the tiny model is no faster
    # on two (measured: 200 lookup steps in 209 s on two threads, ~150 s on one).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _train(model_dir, env_spec, steps=steps, seed=seed, groups=groups,
                      group_size=group_size, flags=flags, settings=settings, push=push)  # fmt: skip
    finally:
        torch.set_num_threads(threads)


def _train(model_dir: Path, env_spec: str, *, steps: int, seed: int, groups: int,
           group_size: int, flags: dict[str, object] | None, settings: EpisodeSettings | None,
           push: bool) -> Run:  # fmt: skip
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    cfg = LearnerConfig.load({"model": model_dir, "group_size": group_size,
                              "groups_per_batch": groups, "max_steps": steps, **(flags or {})},
                             environ={})  # fmt: skip
    core = build_core(cfg, DistContext(), torch.device("cpu"))
    model = core.trainer.model
    sampler = model if push else AutoModelForCausalLM.from_pretrained(model_dir).eval()
    generator = ModelGenerator(sampler)
    ctx = EpisodeContext(load_codec(str(model_dir)), generator, SamplingParams)
    episode = settings or EpisodeSettings(max_tokens=1, temperature=1.0)
    rng = random.Random(seed)
    run = Run(core=core)
    for step in range(steps):
        tasks = [Task(f"s{step}-g{g}", env_spec, group_size, rng.randrange(2**31), step)
                 for g in range(groups)]  # fmt: skip
        batch = asyncio.run(_groups(ctx, episode, tasks))
        prepared, stats = core.train(batch, replay=False)
        run.rewards.append(sum(prepared.episode_returns) / max(len(prepared.episode_returns), 1))
        if stats is not None:
            run.stats.append(stats)
        generator.version = core.state.step if push else 0
    return run


async def _groups(ctx: EpisodeContext, cfg: EpisodeSettings, tasks: list[Task]) -> list[TrajectoryGroup]:  # fmt: skip
    return list(await asyncio.gather(*(
        run_group(ctx, cfg, t, max_turns=8, retries=0, worker_id="in-process") for t in tasks
    )))  # fmt: skip


def window_mean(rewards: Sequence[float], window: int = 10) -> list[float]:
    """The mean of each run of `window` consecutive steps."""
    return [sum(rewards[i - window : i]) / window for i in range(window, len(rewards) + 1)]
