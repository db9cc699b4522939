"""Critic PPO (``--algorithm ppo``): a separate small value model and per-token GAE.

The critic is the policy's initial backbone (``AutoModel`` of ``--model``) with a
linear value head initialised to zero, trained by its own AdamW; keeping it
apart from the policy leaves the policy's forward untouched. Before the policy
update, `Critic.annotate` scores every sequence of the batch: the value of
completion token t is read from the hidden state of the position before it
(the state the token was sampled from), each turn's shaped reward sits on the
turn's last completion token (a per-token KL reward on every token), and
`learner.algorithms.gae` runs across the turns of the episode, skipping the
prompt-side tokens of later turns. A terminated episode ends with V = 0; a
truncated one (a limit cut it) bootstraps from the value of the state after its
last token. The
advantages are whitened over the batch's completion tokens (verl does the
same); the returns are the critic's targets. `Critic.update` then takes the
same epochs and mini-batches as the policy with the clipped value loss.
Every rank scores the whole batch (the advantages' whitening needs all of it);
each trains on its shard. `save_critic` writes ``critic/step-N.pt`` (weights,
head and optimizer) durably *before* the learner's checkpoint of step N, so a
checkpoint never exists without its critic; a resume loads the critic of the
checkpoint's step (`restore_critic`).
"""

from __future__ import annotations

import dataclasses
import io
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from learner.algorithms import gae
from learner.batch import Sample
from learner.config import Aggregation, OptimConfig
from learner.distributed import DistContext
from learner.errors import CheckpointError
from learner.losses import aggregate, clipped_value_loss
from learner.scoring import Scoring, autocast_context, collate, micro_batches, score_tokens
from learner.trainer import split


@dataclass(frozen=True)
class CriticConfig:
    """The critic's share of the learner config."""

    learning_rate: float
    value_clip: float  # clip range of the value loss around the values before the update
    gamma: float  # GAE discount, per completion token
    lam: float  # GAE lambda


def token_rewards(samples: Sequence[Sample]) -> np.ndarray:
    """The rewards on the tokens of one episode's sequences, joined (input coordinates).

    Each turn's reward sits on its last completion token. A turn with none there (it
    sampled no token, or its sequence trains none) puts its reward on the last completion
    token before it: the reward follows that action. With no such token the reward comes
    before every trained token, and no return counts it. A per-token penalty (KL reward)
    is subtracted on every completion token."""
    assert all(s.turn_index is not None for s in samples)
    turn_index = np.concatenate([s.turn_index for s in samples])  # type: ignore[misc]
    out = np.zeros(len(turn_index), np.float64)
    for s, part in zip(samples, _parts(samples), strict=True):
        if s.token_penalty is not None:
            out[part] -= s.token_penalty
    rewards = samples[0].turn_rewards
    assert rewards is not None
    scored = np.flatnonzero(turn_index >= 0)
    for k, reward in enumerate(rewards):
        upto = scored[turn_index[scored] <= k]
        if len(upto):
            out[upto[-1]] += reward
    return out


def _parts(samples: Sequence[Sample]) -> list[slice]:
    """Each sample's span in the samples' joined coordinates."""
    ends = np.cumsum([len(s.input_ids) for s in samples])
    return [slice(int(e - len(s.input_ids)), int(e)) for s, e in zip(samples, ends, strict=True)]


def episode_gae(
    samples: Sequence[Sample],
    values: Sequence[np.ndarray],
    finals: Sequence[float],
    gamma: float,
    lam: float,
) -> list[tuple[np.ndarray, np.ndarray]]:
    """(advantages, returns) of each sample, GAE run over whole episodes: the segments of one
    trajectory (consecutive samples of the same group and episode, in order) are joined, so a
    later segment's reward reaches an earlier one, which bootstraps from the next segment's
    first value instead of 0. `finals` holds each sample's value after its last token: a
    truncated episode (`Sample.bootstrap` on its last sequence) bootstraps from it."""
    out: list[tuple[np.ndarray, np.ndarray]] = []
    start = 0
    while start < len(samples):
        key = (samples[start].group_id, samples[start].episode)
        stop = start + 1
        while stop < len(samples) and (samples[stop].group_id, samples[stop].episode) == key:
            stop += 1
        part = samples[start:stop]
        adv, ret = gae(
            token_rewards(part),
            np.concatenate(values[start:stop]),
            np.concatenate([s.loss_mask for s in part]),
            gamma,
            lam,
            bootstrap=finals[stop - 1] if part[-1].bootstrap else 0.0,
        )
        cuts = np.cumsum([len(s.input_ids) for s in part])[:-1]
        out += zip(np.split(adv, cuts), np.split(ret, cuts), strict=True)
        start = stop
    return out


def whiten(advantages: Sequence[np.ndarray], masks: Sequence[np.ndarray]) -> list[np.ndarray]:
    """``(A - mean) / (std + 1e-8)`` over every masked-in token of the batch."""
    flat = np.concatenate([a[m > 0] for a, m in zip(advantages, masks, strict=True)])
    if not len(flat):
        return list(advantages)
    mean, std = flat.mean(), flat.std()
    return [
        np.where(m > 0, (a - mean) / (std + 1e-8), 0.0)
        for a, m in zip(advantages, masks, strict=True)
    ]


class Critic:
    """Value model, its optimizer, GAE annotation and the clipped value loss."""

    def __init__(
        self,
        backbone: torch.nn.Module,
        cfg: CriticConfig,
        optim: OptimConfig,
        device: torch.device,
        dist: DistContext,
    ) -> None:
        self.backbone = backbone.to(device).eval()
        hidden = int(backbone.config.hidden_size)  # type: ignore[union-attr]
        self.head = torch.nn.Linear(hidden, 1).to(device)
        torch.nn.init.zeros_(self.head.weight)
        torch.nn.init.zeros_(self.head.bias)
        self.modules = torch.nn.ModuleList([self.backbone, self.head])
        self.cfg, self.optim, self.device, self.dist = cfg, optim, device, dist
        self.bf16 = optim.bf16(device.type)
        self.optimizer = torch.optim.AdamW(self.modules.parameters(), lr=cfg.learning_rate)
        pad = getattr(backbone.config, "pad_token_id", None)
        self.pad_id = int(pad) if pad is not None else 0

    def states(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """``[B, T]``: entry t is the value of the state after input token t."""
        out = self.backbone(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
        return self.head(out.last_hidden_state.float()).squeeze(-1)

    def values(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """``[B, T-1]``: entry t is the value of the state before input token t+1."""
        return self.states(batch)[:, :-1]

    def estimate(self, samples: Sequence[Sample]) -> list[np.ndarray]:
        """Values in input coordinates (entry 0, before which there is no state, is 0), with
        one entry more at the end: the value of the state after the sample's last token."""
        scoring = Scoring(self.optim.micro_batch_size, self.bf16, self.pad_id, self.device)
        return score_tokens(samples, scoring, self.states, np.float64, tail=True)

    def annotate(self, samples: Sequence[Sample]) -> list[Sample]:
        """Samples with GAE advantages (whitened), the values and the returns."""
        estimated = self.estimate(samples)
        values, finals = [v[:-1] for v in estimated], [float(v[-1]) for v in estimated]
        pairs = episode_gae(samples, values, finals, self.cfg.gamma, self.cfg.lam)
        advantages = whiten([a for a, _ in pairs], [s.loss_mask for s in samples])
        return [
            dataclasses.replace(s, advantages=a.astype(np.float32), old_values=v, returns=r)
            for s, a, v, (_, r) in zip(samples, advantages, values, pairs, strict=True)
        ]

    def update(self, samples: Sequence[Sample], epochs: int, mini_batches: int) -> float:
        """The clipped value loss over epochs and mini-batches; returns its mean."""
        losses = [
            self._step(self.dist.shard(mini), int(sum(s.loss_mask.sum() for s in mini)), len(mini))
            for _ in range(epochs)
            for mini in split(samples, mini_batches)
        ]
        return float(np.mean(losses)) if losses else 0.0

    def _step(self, local: Sequence[Sample], tokens: int, sequences: int) -> float:
        self.optimizer.zero_grad(set_to_none=False)
        total = torch.zeros(4, dtype=torch.float64)
        for chunk in micro_batches(local, self.optim.micro_batch_size):
            batch = collate(chunk, self.pad_id, self.device)
            old, ret = (self._padded(chunk, name, batch) for name in ("old_values", "returns"))
            with autocast_context(self.device, self.bf16):
                v = self.values(batch)
            loss = clipped_value_loss(v, old, ret, self.cfg.value_clip)
            share = aggregate(
                loss,
                batch["mask"][:, 1:],
                # --aggregation, else token-mean: GSPO's default concerns the policy's ratio
                self.optim.aggregation or Aggregation.TOKEN_MEAN,
                total_tokens=tokens,
                total_sequences=sequences,
            )
            share.backward()
            total[0] += float(share.detach())
        self.dist.all_reduce_grads(self.modules)
        torch.nn.utils.clip_grad_norm_(self.modules.parameters(), self.optim.max_grad_norm)
        self.optimizer.step()
        return float(self.dist.reduce_sums(total)[0])

    def _padded(
        self, chunk: Sequence[Sample], name: str, batch: dict[str, torch.Tensor]
    ) -> torch.Tensor:
        """A per-sample array as ``[B, T-1]`` aligned with `values` (target coordinates)."""
        out = torch.zeros_like(batch["mask"])
        for i, s in enumerate(chunk):
            out[i, : len(s.input_ids)] = torch.from_numpy(getattr(s, name).astype(np.float32))
        return out[:, 1:]


def load_critic(
    model_dir: Path, cfg: CriticConfig, optim: OptimConfig, device: torch.device, dist: DistContext
) -> Critic:
    """A critic on the initial backbone of `model_dir` (every rank the same: seeded head)."""
    from transformers import AutoModel

    return Critic(
        AutoModel.from_pretrained(model_dir, dtype=torch.float32), cfg, optim, device, dist
    )


log = logging.getLogger(__name__)
CRITIC_DIR = "critic"


def save_critic(critic: Critic, checkpoint_dir: Path, step: int, keep: int) -> Path:
    """``critic/step-<step>.pt``, fsynced and renamed into place; older ones pruned."""
    folder = checkpoint_dir / CRITIC_DIR
    final = folder / f"step-{step:08d}.pt"
    buffer = io.BytesIO()
    torch.save(
        {"modules": critic.modules.state_dict(), "optimizer": critic.optimizer.state_dict()}, buffer
    )
    try:
        folder.mkdir(parents=True, exist_ok=True)
        tmp = final.with_name(f".{final.name}.tmp")
        with open(tmp, "wb") as f:
            f.write(buffer.getvalue())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as exc:
        raise CheckpointError(f"cannot write critic {final}: {exc}") from exc
    # the learner keeps `keep` checkpoints; keep one critic more for the one being written
    for old in sorted(folder.glob("step-*.pt"))[: -(keep + 1)]:
        old.unlink(missing_ok=True)
    return final


def restore_critic(critic: Critic, checkpoint_dir: Path, step: int) -> bool:
    """Load the critic saved with checkpoint `step`; False (and a warning) when there is none."""
    path = checkpoint_dir / CRITIC_DIR / f"step-{step:08d}.pt"
    if not path.is_file():
        log.warning("no critic saved with step %d: the critic starts afresh", step)
        return False
    try:
        data = torch.load(path, weights_only=True, map_location=critic.device)
        critic.modules.load_state_dict(data["modules"])
        critic.optimizer.load_state_dict(data["optimizer"])
    except (OSError, RuntimeError, KeyError, ValueError) as exc:
        raise CheckpointError(f"cannot read critic {path}: {exc}") from exc
    return True
