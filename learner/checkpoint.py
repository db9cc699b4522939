"""Crash-safe checkpoints: sharded training state, a servable export, the learner's own state.

A checkpoint is a directory ``step-00000042/`` holding
* ``dcp/``: the model and AdamW state written by every rank with
  ``torch.distributed.checkpoint`` (each rank its own shards; loading reshards, so a
  checkpoint resumes exactly under FSDP, and under any world size);
* a complete Hugging Face model directory (``model.safetensors`` streamed one gathered
  tensor at a time, config, tokenizer files; `learner.export`): vLLM and the CPU server
  load it as is. A LoRA run (`learner.lora`) writes its peft adapter directory
  ``adapter/`` instead, and ``dcp/`` holds only the trainable tensors and their AdamW
  state: the frozen base is ``--model``'s;
* ``state.json`` (`LearnerState`: step, policy version, the group ids trained at each step,
  the last trained entry per stream, the task sampler's state, counters).

Saving is collective: every rank calls `save_checkpoint`; rank 0 alone writes the export
and the state and moves the directory into place.

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

import contextlib
import json
import os
import shutil
import warnings
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as tdist

from learner.distributed import DistContext
from learner.errors import CheckpointError
from learner.export import export_hf_dir
from learner.lora import is_lora, save_adapter

if TYPE_CHECKING:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

LATEST = "LATEST"
STATE = "state.json"
SHARDS = "dcp"
ADAPTER_DIR = "adapter"  # a LoRA run's peft adapter, in place of the full export
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
    kl_coef: float | None = None  # the adaptive KL controller's coefficient (None: the config's)

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


@contextlib.contextmanager
def _quiet_single_process() -> Iterator[None]:
    """DCP warns on every save/load without a process group: one process is intended here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _options(policy: torch.nn.Module) -> StateDictOptions:
    """Frozen parameters (LoRA's base) are ``--model``'s: neither saved nor loaded."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    frozen = any(not p.requires_grad for p in policy.parameters())
    return StateDictOptions(ignore_frozen_params=frozen, strict=not frozen)


def _training_state(
    policy: torch.nn.Module, optimizer: torch.optim.Optimizer
) -> dict[str, dict[str, Any]]:
    # torch.distributed.checkpoint takes ~0.3-1 s to import: paid at the first save or
    # resume, not by every learner's start-up (a run may never write a checkpoint)
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(policy, optimizer, options=_options(policy))
    return {"model": model_sd, "optim": optim_sd}


def save_checkpoint(
    root: Path,
    policy: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    state: LearnerState,
    dist: DistContext,
    *,
    tokenizer_dir: Path | None = None,
    keep: int = 2,
) -> Path:
    """Write checkpoint ``step-<state.step>`` durably, point LATEST at it, prune old ones.

    Collective: every rank calls it. ``policy.lm`` is the Hugging Face model exported.
    """
    final = root / f"step-{state.step:08d}"
    tmp = root / f".tmp-step-{state.step:08d}"  # the same name on every rank
    try:
        if dist.is_main:
            root.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()
        dist.barrier()
        import torch.distributed.checkpoint as dcp

        with _quiet_single_process():
            dcp.save(
                _training_state(policy, optimizer),
                checkpoint_id=tmp / SHARDS,
                no_dist=not dist.enabled,
            )
        if is_lora(policy.lm):  # type: ignore[arg-type]
            save_adapter(policy.lm, tmp / ADAPTER_DIR, dist.is_main)  # type: ignore[arg-type]
        else:
            export_hf_dir(policy.lm, tmp, dist.is_main, tokenizer_dir)  # type: ignore[arg-type]
        if dist.is_main:
            (tmp / STATE).write_text(json.dumps(asdict(state)))
            _fsync_tree(tmp)
            if final.exists():  # a crash after the rename but before LATEST moved
                shutil.rmtree(final)
            os.rename(tmp, final)
            _fsync_file(root)
            _write_atomic(root / LATEST, final.name.encode())
            _prune(root, keep)
    except OSError as exc:
        raise CheckpointError(f"cannot write checkpoint {final}: {exc}") from exc
    finally:
        dist.barrier()
    return final


def load_training_state(
    path: Path, policy: torch.nn.Module, optimizer: torch.optim.Optimizer
) -> None:
    """Load the sharded model and optimizer state of checkpoint `path` (collective)."""
    if not (path / SHARDS).is_dir():
        raise CheckpointError(f"{path} has no {SHARDS}/ (a checkpoint from before sharded state)")
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    try:
        target = _training_state(policy, optimizer)
        with _quiet_single_process():
            dcp.load(target, checkpoint_id=path / SHARDS, no_dist=not tdist.is_initialized())
        set_state_dict(
            policy,
            optimizer,
            model_state_dict=target["model"],
            optim_state_dict=target["optim"],
            options=_options(policy),
        )
    except (OSError, RuntimeError, ValueError) as exc:
        raise CheckpointError(f"cannot load training state from {path}: {exc}") from exc


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
