"""Crash-safe checkpoints: weights, optimizer state and the learner's own state.

A checkpoint is a directory ``step-00000042/`` holding a complete Hugging Face
model directory (``model.safetensors``, config, tokenizer files copied from the
base model, so it can be served as is), ``optimizer.pt`` and ``state.json``
(`LearnerState`: step, policy version, the group ids trained at each step, the
last trained entry per stream, the task sampler's state, counters).

Invariant: a checkpoint directory that exists under its final name is complete.
It is written under a temporary name, every file and the directory are fsynced,
then it is renamed into place and the parent directory fsynced; ``LATEST`` is
replaced the same way. The learner acks trajectory entries only after this
returns, so a SIGKILL at any instant leaves either the previous checkpoint (and
the entries still pending, to be redelivered and trained again from its weights)
or the new one (and the entries acked, or, if the kill fell between the rename and
the ack, still pending: the resumed learner recognises their group ids in the
state's recent history and acks them without training).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from learner.errors import CheckpointError

LATEST = "LATEST"
STATE = "state.json"
OPTIMIZER = "optimizer.pt"
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                    "chat_template.jinja", "vocab.json", "merges.txt")  # fmt: skip
TRAINED_HISTORY_STEPS = 100_000  # bound on the per-step group-id history kept in state.json


@dataclass
class LearnerState:
    """Everything besides tensors that a resumed learner needs."""

    step: int = 0
    version: int = 0
    trained: list[list[str]] = field(default_factory=list)  # group ids trained at each step
    positions: dict[str, str] = field(default_factory=dict)  # stream -> last trained entry id
    sampler: dict[str, Any] = field(default_factory=dict)  # task sampler state
    counters: dict[str, int] = field(default_factory=dict)  # groups trained/dropped/skipped...

    def record_step(self, group_ids: list[str]) -> None:
        self.trained.append(group_ids)
        del self.trained[:-TRAINED_HISTORY_STEPS]

    def count(self, name: str, n: int = 1) -> None:
        self.counters[name] = self.counters.get(name, 0) + n

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> LearnerState:
        return cls(**{k: data[k] for k in cls.__dataclass_fields__ if k in data})


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(root: Path) -> None:
    for path in sorted(root.rglob("*")):
        if path.is_file():
            _fsync_file(path)
    _fsync_file(root)


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_file(path.parent)


def save_checkpoint(
    root: Path,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    state: LearnerState,
    *,
    tokenizer_dir: Path | None = None,
    keep: int = 2,
) -> Path:
    """Write checkpoint ``step-<state.step>`` durably, point LATEST at it, prune old ones."""
    final = root / f"step-{state.step:08d}"
    try:
        root.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".tmp-step-", dir=root))
        model.save_pretrained(tmp, safe_serialization=True)  # type: ignore[operator]
        for name in _TOKENIZER_FILES:
            if tokenizer_dir is not None and (tokenizer_dir / name).is_file():
                shutil.copy2(tokenizer_dir / name, tmp / name)
        torch.save(optimizer.state_dict(), tmp / OPTIMIZER)
        (tmp / STATE).write_text(json.dumps(asdict(state)))
        _fsync_tree(tmp)
        if final.exists():  # a crash after the rename but before LATEST moved
            shutil.rmtree(final)
        os.rename(tmp, final)
        _fsync_file(root)
        _write_atomic(root / LATEST, final.name.encode())
    except OSError as exc:
        raise CheckpointError(f"cannot write checkpoint {final}: {exc}") from exc
    _prune(root, keep)
    return final


def _prune(root: Path, keep: int) -> None:
    steps = sorted(p for p in root.glob("step-*") if p.is_dir())
    for old in steps[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    for tmp in root.glob(".tmp-step-*"):  # leftovers of a crash mid-write
        shutil.rmtree(tmp, ignore_errors=True)


def latest_checkpoint(root: Path) -> Path | None:
    """The checkpoint LATEST names, or None when there is none yet."""
    pointer = root / LATEST
    if not pointer.is_file():
        return None
    path = root / pointer.read_text().strip()
    if not (path / STATE).is_file():
        raise CheckpointError(f"{pointer} names {path}, which is not a complete checkpoint")
    return path


def load_state(path: Path) -> LearnerState:
    try:
        return LearnerState.from_json(json.loads((path / STATE).read_text()))
    except (OSError, ValueError, TypeError) as exc:
        raise CheckpointError(f"cannot read learner state from {path}: {exc}") from exc


def load_optimizer(path: Path, optimizer: torch.optim.Optimizer) -> None:
    try:
        optimizer.load_state_dict(torch.load(path / OPTIMIZER, weights_only=True))
    except (OSError, RuntimeError, ValueError) as exc:
        raise CheckpointError(f"cannot read optimizer state from {path}: {exc}") from exc
