"""`ModelGenerator`'s lean path (a shared prefix prefilled once, finished rows dropped) samples
what the plain left-padded batch samples: the same greedy tokens and the same logprobs to
float precision, on prompts that share a prefix and differ in length after it."""

from __future__ import annotations

import asyncio
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from inference.client import Generation, SamplingParams
from tests.learner.inprocess import ModelGenerator

SHARED = list(range(40, 90))  # a "system prompt" every row starts with
PROMPTS = [[*SHARED, 7], [*SHARED, 8, 9, 10, 11], [*SHARED, 12, 13], [*SHARED[:30], 99]]


def generate(model: torch.nn.Module, prompts: list[list[int]], lean: bool) -> list[Generation]:
    generator = ModelGenerator(model, lean=lean)

    async def batch() -> list[Generation]:
        # rows stop at different lengths, so the lean path drops some mid-decode
        params = [
            SamplingParams(max_tokens=5 + 7 * i, temperature=0.0) for i in range(len(prompts))
        ]
        return list(
            await asyncio.gather(
                *(
                    generator.generate(p, q, session_id=f"s{i}")
                    for i, (p, q) in enumerate(zip(prompts, params, strict=True))
                )
            )
        )

    return asyncio.run(batch())


def test_the_lean_batch_samples_what_the_plain_batch_samples(tiny_model_dir: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    for prompts in (PROMPTS[:3], PROMPTS):  # a 50-token shared prefix; then one of 30
        plain, lean = generate(model, prompts, False), generate(model, prompts, True)
        assert [g.token_ids for g in lean] == [g.token_ids for g in plain]
        assert [len(g.token_ids) for g in lean] == [5 + 7 * i for i in range(len(prompts))]
        for a, b in zip(lean, plain, strict=True):
            torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs))
