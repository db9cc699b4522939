"""Token alignment on a real multi-turn episode against the real CPU policy server."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from broker.messages import ErrorCategory, Task
from inference.client import GenerationClient, SamplingParams
from inference.config import ClientConfig
from tests.workers import testenvs
from workers.episode import EpisodeContext, EpisodeSettings
from workers.group import run_group
from workers.tokens import load_codec


async def test_masked_tokens_reproduce_text_observations_and_logprobs(
    policy_server, tiny_model_dir: Path
) -> None:
    codec = load_codec(str(tiny_model_dir))
    task = Task("t-align", 'wk-dialogue@{"turns": 3}', group_size=3, seed=100, policy_version=0)
    settings = EpisodeSettings(max_tokens=12, max_context_tokens=1024)
    async with GenerationClient([policy_server.url], ClientConfig(request_timeout_s=30)) as client:
        ctx = EpisodeContext(codec=codec, client=client, sampling=SamplingParams)
        group = await run_group(ctx, settings, task, max_turns=8, retries=0, worker_id="w")

    assert [t.sample_index for t in group.trajectories] == [0, 1, 2]
    model = _load_model(tiny_model_dir)
    # One prompt for the group: every episode was reset with the task's seed.
    transcripts = list(testenvs.TRANSCRIPTS[task.seed])
    assert len(transcripts) == 3 and len({t[0] for t in transcripts}) == 1
    for traj in group.trajectories:
        assert traj.error is ErrorCategory.NONE and traj.finish_reason == "terminated"
        assert len(traj.turns) == 3 and [t.reward for t in traj.turns] == [1.0, 2.0, 3.0]
        said = [codec.decode(turn.completion_ids) for turn in traj.turns]
        # the episode's own transcript: the one whose actions it produced (each used once)
        transcript = next(t for t in transcripts if [x for k, x in t if k == "action"] == said)
        transcripts.remove(transcript)
        observations = [text for kind, text in transcript if kind == "obs"]
        actions = [text for kind, text in transcript if kind == "action"]
        for i, turn in enumerate(traj.turns):
            # Masked-in tokens: exactly the text the environment received as the action.
            assert codec.decode(turn.completion_ids) == actions[i]
            # Masked-out tokens: exactly the observation, inside the template's markers.
            prompt_text = codec.decode(turn.prompt_ids, skip_special=False)
            if i == 0:
                assert prompt_text.endswith(
                    f"user\n{observations[0]}<|im_end|>\n<|im_start|>assistant\n"
                )
            else:
                tail = (
                    ""
                    if traj.turns[i - 1].completion_ids[-1] == codec.stop_token_ids[0]
                    else "<|im_end|>"
                )
                wanted = f"{tail}\n<|im_start|>user\n{observations[i]}<|im_end|>\n<|im_start|>assistant\n"
                assert prompt_text == wanted
        _assert_logprobs_match(model, traj)


def _load_model(model_dir: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(model_dir), local_files_only=True).eval()


def _assert_logprobs_match(model, traj) -> None:
    """Teacher-force the whole episode: the recorded logprobs line up one to one."""
    import torch

    ids, mask, recorded = [], [], []
    for turn in traj.turns:
        ids += [*turn.prompt_ids.tolist(), *turn.completion_ids.tolist()]
        mask += [0] * len(turn.prompt_ids) + [1] * len(turn.completion_ids)
        recorded += turn.logprobs.tolist()
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    logp = torch.log_softmax(logits[:-1], dim=-1)
    target = torch.tensor(ids[1:])
    per_token = logp.gather(1, target[:, None])[:, 0].numpy()
    positions = np.nonzero(np.array(mask[1:]) == 1)[0]
    assert len(positions) == len(recorded) and mask[0] == 0
    np.testing.assert_allclose(per_token[positions], np.array(recorded), atol=2e-3)
