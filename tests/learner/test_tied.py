"""The tied embedding's gradient, added into the head's in place, equals autograd's own."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from transformers import AutoModelForCausalLM

from broker.messages import Sampling
from learner.batch import Sample
from learner.logprobs import chunked_logprobs
from learner.microbatch import collate
from learner.policy import PolicyModel


def _samples(vocab: int, pad: int) -> list[Sample]:
    rng = np.random.default_rng(0)
    out = []
    for i, length in enumerate((9, 14)):  # unequal: the shorter row is padded with `pad`
        ids = rng.integers(0, vocab, length)
        ids[2] = pad  # the padding token inside a sequence: its row gets no gradient
        out.append(
            Sample(
                input_ids=ids,
                loss_mask=np.ones(length, np.float32),
                behaviour_logp=np.zeros(length, np.float32),
                advantages=np.ones(length, np.float32),
                sampling_index=np.zeros(length, np.int32),
                stale=False,
                group_id=f"g{i}",
                samplings=(Sampling(0.8),),
            )
        )
    return out


def test_tied_embedding_gradient_equals_autograds(tiny_model_dir: Path) -> None:
    torch.manual_seed(0)
    lm = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float64)
    embed, head = lm.get_input_embeddings(), lm.get_output_embeddings()
    assert embed.weight is head.weight and embed.padding_idx is not None
    policy = PolicyModel(lm, chunk_tokens=5)
    batch = collate(
        _samples(head.weight.shape[0], embed.padding_idx), embed.padding_idx, torch.device("cpu")
    )

    def plain() -> tuple[torch.Tensor, ...]:  # nn.Embedding's own backward, autograd sums
        out = lm.base_model(
            input_ids=batch["input_ids"],
            attention_mask=batch["attention_mask"],
            position_ids=batch["position_ids"],
            use_cache=False,
        )
        hidden = out.last_hidden_state.reshape(-1, out.last_hidden_state.shape[-1])
        scored = hidden.index_select(0, batch["src"])
        return chunked_logprobs(scored, head, batch["targets"], batch["sampling"], 5)

    def grads(forward: Callable[[], tuple[torch.Tensor, ...]]) -> dict[str, torch.Tensor]:
        lm.zero_grad(set_to_none=True)
        for scale in (1.0, -0.5):  # two micro-batches: the second adds into existing .grad
            logp, entropy, _ = forward()
            (scale * logp.sum() + 0.3 * entropy.sum()).backward()
        return {name: p.grad.clone() for name, p in lm.named_parameters()}

    ours, want = grads(lambda: policy(batch)), grads(plain)
    assert ours.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(ours[name], want[name], rtol=1e-9, atol=1e-12, msg=name)
    assert float(ours["model.embed_tokens.weight"][embed.padding_idx].abs().sum()) > 0  # head's
