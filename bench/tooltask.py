"""Tool-task benchmark: how a base model does on a multi-turn tool environment before training.

For each environment spec (default: three of the `calc` prompts docs/envs.md compares), `--problems`
held-out problems (rows ``{"index": i}``, `envs.calc.split_lines`) are run `--k` times each
through the workers' own episode code (`workers.group.run_group`: the model's chat template
via `ChatCodec`, the run's tool parser via `AnswerReader`, the environment's turns) against the
CPU policy server's `Engine` in this process (its batching, prefix cache and sampling, no
HTTP), so what is measured is what the farm samples. Each finished episode is replayed
through a fresh environment with the same answers to read its steps' infos, and reported:

- tool-call rate: episodes whose model attempted a call (well-formed or not);
- good-call rate: episodes with a call the calculator evaluated;
- right-call rate: episodes with a call whose result is the answer;
- success: reward 1 (the final answer right, after a successful call where required);
- right without the tool: a final answer that is right though no call succeeded.

`python -m bench tooltask [--spec SPEC ...] [--problems 40] [--k 4] [--max-tokens 64]`;
`--model DIR` (default: `inference.models`' SmolLM2, converted if needed), `--tool-parser`
(default hermes, SmolLM2's family), `--smoke` (the tiny random model, 2 problems x 2).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import tempfile
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import envs
from bench import _report as report
from broker.messages import Task
from envs.calc import split_lines
from inference.client import Generation, SamplingParams
from launch.settings import HelpFormatter
from workers.answers import AnswerReader
from workers.config import EpisodeSettings
from workers.episode import EpisodeContext
from workers.group import run_group
from workers.tokens import load_codec

SPECS = (  # the chosen prompt, the same without worked exchanges, and the easy tag syntax
    'calc@{"shots": 2}',
    'calc@{"shots": 0}',
    'calc@{"style": "tag", "shots": 2}',
)


class EngineGenerator:
    """The CPU policy server's engine as an episode's `Generator`, in this process."""

    def __init__(self, model_dir: Path) -> None:
        from inference.config import ServerConfig
        from inference.server import load_engine

        config = ServerConfig(model=model_dir, batch_window_ms=20)
        self.engine, _, _ = load_engine(config)

    async def generate(
        self, prompt_ids: Sequence[int], params: SamplingParams, *, session_id: str
    ) -> Generation:
        from inference.sampling import SampleSpec
        from inference.sequence import GenParams, GenRequest

        spec = SampleSpec(params.distribution(), 0)
        stops = frozenset(params.stop_token_ids)
        gen = GenRequest(
            list(prompt_ids), GenParams(1, params.max_tokens, spec, params.seed, stops, False)
        )
        self.engine.submit(gen)
        await gen.done
        seq = gen.seqs[0]
        versions = [0] * len(seq.tokens)
        return Generation(seq.tokens, seq.logprobs, versions, seq.finish_reason or "", "engine")

    def end_session(self, session_id: str) -> None:
        """No sticky servers in one process."""

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[EngineGenerator]:
        loop = asyncio.create_task(self.engine.run(), name="engine-loop")
        try:
            yield self
        finally:
            loop.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await loop


@dataclass
class Tally:
    """Counts over the episodes of one spec."""

    episodes: int = 0
    called: int = 0
    good_call: int = 0
    right_call: int = 0
    success: int = 0
    right_without_tool: int = 0
    turns: int = 0

    def add(self, infos: list[dict[str, Any]], reward: float) -> None:
        results = [r for info in infos for r in info.get("tool_results", ())]
        answer = infos[0]["answer"] if infos else None
        self.episodes += 1
        self.turns += len(infos)
        self.called += any("tool_results" in i or "error" in i for i in infos)
        self.good_call += any(not r.startswith("Error") for r in results)
        self.right_call += answer in results
        self.success += reward >= 1.0
        last = infos[-1] if infos else {}
        self.right_without_tool += last.get("correct") is False and _right_number(last)

    def row(self) -> dict[str, float]:
        n = max(self.episodes, 1)
        return {
            "episodes": self.episodes,
            "tool_call": self.called / n,
            "good_call": self.good_call / n,
            "right_call": self.right_call / n,
            "success": self.success / n,
            "right_without_tool": self.right_without_tool / n,
            "turns_per_episode": self.turns / n,
        }


def _right_number(info: dict[str, Any]) -> bool:
    return info.get("said") is not None and info.get("said") == info.get("answer")


async def measure(
    ctx: EpisodeContext, spec: str, problems: int, k: int, settings: EpisodeSettings
) -> tuple[dict[str, float], list[str]]:
    """The tally of `problems` held-out problems x `k` episodes of `spec`, and some replies."""
    _, kwargs = envs.parse_spec(spec)
    lines = split_lines(**{key: v for key, v in kwargs.items() if key != "split"})[:problems]
    tasks = [
        Task(f"tool-{i}", row["env_spec"], k, i, 0, row=row["row"])
        for i, row in enumerate(json.loads(line) for line in lines)
    ]
    groups = await asyncio.gather(
        *(run_group(ctx, settings, t, max_turns=16, retries=0, worker_id="bench") for t in tasks)
    )
    tally, samples = Tally(), []
    for task, group in zip(tasks, groups, strict=True):
        for trajectory in group.trajectories:
            infos, texts = await _replay(ctx, task, trajectory)
            tally.add(infos, sum(t.reward for t in trajectory.turns))
            if len(samples) < 6:
                samples.append(" || ".join(texts))
    return tally.row(), samples


async def _replay(ctx: EpisodeContext, task: Task, trajectory: Any) -> tuple[list[dict], list[str]]:
    """Step a fresh environment with the episode's answers, as read by the run's reader."""
    env = envs.make(task.env_spec)
    await envs.areset(env, seed=task.seed, options={"row": task.row})
    infos, texts = [], []
    for turn in trajectory.turns:
        action = ctx.reader.read(turn.completion_ids).action
        texts.append(str(action)[:160])
        *_, info = await envs.astep(env, action)
        infos.append(info)
    return infos, texts


def _table(rows: dict[str, dict[str, float]], head: str) -> str:
    lines = [
        head,
        "| spec | episodes | tool call | good call | right call | success | right, no tool |",
        "|---|---|---|---|---|---|---|",
    ]
    for spec, r in rows.items():
        lines.append(
            f"| `{spec}` | {r['episodes']} | {r['tool_call']:.1%} | {r['good_call']:.1%} | "
            f"{r['right_call']:.1%} | {r['success']:.1%} | {r['right_without_tool']:.1%} |"
        )
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m bench tooltask", description=__doc__, formatter_class=HelpFormatter
    )
    parser.add_argument("--spec", action="append", help="an environment spec (repeatable)")
    parser.add_argument("--model", type=Path, help="model directory (default: SmolLM2)")
    parser.add_argument("--problems", type=int, default=40, help="held-out problems per spec")
    parser.add_argument("--k", type=int, default=4, help="episodes per problem")
    parser.add_argument("--max-tokens", type=int, default=64, help="new tokens per turn")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--tool-parser", default="hermes", help="the run's tool parser")
    parser.add_argument("--samples", action="store_true", help="print a few episodes per spec")
    parser.add_argument("--smoke", action="store_true", help="tiny random model, 2 x 2")
    parser.add_argument("--json", action="store_true", help="print the JSON envelope")
    return parser


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    run = report.start("tooltask", argv)
    specs = args.spec or list(SPECS)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = _model_dir(args, Path(tmp))
        if args.smoke:
            args.problems, args.k, args.max_tokens = 2, 2, 8
        settings = EpisodeSettings(max_tokens=args.max_tokens, temperature=args.temperature)
        rows, samples, seconds = asyncio.run(_run(model_dir, specs, args, settings))
    head = (
        f"{model_dir.name}: {args.problems} held-out problems x {args.k} episodes per spec, "
        f"temperature {args.temperature}, {args.max_tokens} tokens a turn, "
        f"{args.tool_parser} parser; {seconds:.0f} s"
    )
    table = _table(rows, head)
    if args.samples:
        table += "\n" + "\n".join(f"{s}: {t!r}" for s, texts in samples.items() for t in texts)
    return report.emit(run, {"rows": rows, "seconds": seconds}, table, args.json)


def _model_dir(args: argparse.Namespace, tmp: Path) -> Path:
    if args.smoke:
        from inference.tiny import build_tiny_model

        return build_tiny_model(tmp / "tiny")
    if args.model is not None:
        return args.model
    from inference.models import ensure_model

    return ensure_model("smollm2")


async def _run(
    model_dir: Path, specs: list[str], args: argparse.Namespace, settings: EpisodeSettings
) -> tuple[dict[str, dict[str, float]], dict[str, list[str]], float]:
    generator = EngineGenerator(model_dir)  # first: the codec would hide torch from transformers
    codec = load_codec(str(model_dir))
    reader = AnswerReader(codec, args.tool_parser)
    ctx = EpisodeContext(codec, generator, SamplingParams, reader=reader)
    rows, samples = {}, {}
    started = time.perf_counter()
    async with generator.running():
        for spec in specs:
            rows[spec], samples[spec] = await measure(ctx, spec, args.problems, args.k, settings)
    return rows, samples, time.perf_counter() - started
