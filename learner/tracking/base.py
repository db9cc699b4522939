"""The tracker the learner holds: one fan-out over the backends, each failure contained.

`open_tracker` builds the backends named by ``--tracker`` (importing wandb or
tensorboard only then) and hands them the resolved config. `Tracker.step` turns a
`StepRecord` into namespaced scalars (``loss/loss``, ``ratio/clip_fraction``,
``reward/adv_std``, ``staleness/staleness_max``, ``throughput/wait_share``, ...) and,
every ``tracker_sample_interval`` steps, adds a table of sample trajectories;
`Tracker.skip` counts skipped batches (``batch/skipped_batches``) and logs what their
groups scored (``batch/skipped_reward_mean``, ``batch/skipped_zero_variance[_reward]``). A backend that raises
is logged once, with its traceback, and dropped: a crashed wandb service or a full disk
costs the charts, never the training run. This module imports neither torch nor a
tracker library; tokenizer and backends load on demand.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import logging
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from learner.tracking.config import TrackerKind, TrackingConfig

if TYPE_CHECKING:
    from broker.messages import TrajectoryGroup
    from learner.batch import PreparedBatch
    from learner.evaluation import EvalResult
    from learner.record import SkipRecord, StepRecord
    from learner.tracking.render import Decode
    from learner.tracking.samples import SampleTable

log = logging.getLogger("learner.tracking")

# StepRecord field -> chart section; fields not listed go under "batch/"
SECTIONS = {
    "loss": ("loss", "entropy", "kl", "value_loss", "grad_norm"),
    "ratio": (
        "clip_fraction",
        "ratio_mean",
        "ratio_max",
        "dual_clip_fraction",
        "correction_fraction",
        "behaviour_ratio_mean",
        "behaviour_ratio_max",
    ),
    "reward": ("reward_mean", "adv_mean", "adv_std"),
    "staleness": ("staleness_max", "stale_dropped", "stale_corrected"),
    "throughput": ("samples", "tokens", "wait_s", "compute_s", "push_s", "samples_per_s"),
}
SECTION_OF = {name: section for section, names in SECTIONS.items() for name in names}
PACKAGES = {TrackerKind.WANDB: "wandb", TrackerKind.TENSORBOARD: "tensorboard"}


class Backend(Protocol):
    """One tracker library. Any exception it raises disables it for the rest of the run."""

    name: str

    def log_scalars(self, step: int, scalars: Mapping[str, float]) -> None: ...

    def log_samples(self, table: SampleTable) -> None: ...

    def close(self) -> None: ...


def scalars_of(record: StepRecord) -> dict[str, float]:
    """The record's figures by chart name (absent statistics left out), plus the wait share."""
    out = {}
    for field in dataclasses.fields(record):
        value = getattr(record, field.name)
        if field.name != "step" and value is not None:
            out[f"{SECTION_OF.get(field.name, 'batch')}/{field.name}"] = float(value)
    busy = record.wait_s + record.compute_s + record.push_s
    out["throughput/wait_share"] = record.wait_s / busy if busy > 0 else 0.0
    return out


class Tracker:
    """What the learner calls: `step` per step, `skip` per skipped batch, `close` once."""

    def __init__(
        self, backends: Sequence[Backend], cfg: TrackingConfig, decoder: Callable[[], Decode]
    ) -> None:
        self.backends = list(backends)
        self.cfg = cfg
        self._decoder = decoder  # loads the tokenizer on the first sample table
        self._decode: Decode | None = None
        self.samples_on = True  # off after a sample table could not be built
        self.skipped = 0

    @classmethod
    def off(cls) -> Tracker:
        """A tracker with no backend (--tracker none, and every rank but 0)."""
        return cls([], TrackingConfig(), lambda: lambda ids: " ".join(map(str, ids)))

    def step(
        self, record: StepRecord, groups: Sequence[TrajectoryGroup], prepared: PreparedBatch
    ) -> None:
        """Log one step's figures, and its sample table when one is due."""
        if not self.backends:
            return
        scalars = scalars_of(record)
        self._each(record.step, lambda b: b.log_scalars(record.step, scalars))
        every = self.cfg.tracker_sample_interval
        if every and record.step % every == 0 and self.samples_on:
            table = self._table(record.step, groups, prepared)
            if table is not None:
                self._each(record.step, lambda b: b.log_samples(table))

    def _table(
        self, step: int, groups: Sequence[TrajectoryGroup], prepared: PreparedBatch
    ) -> SampleTable | None:
        """The step's sample table; a failure (no tokenizer) turns sample tables off."""
        from learner.tracking.samples import sample_table

        try:
            if self._decode is None:
                self._decode = self._decoder()
            rows = self.cfg.tracker_sample_rows
            return sample_table(step, groups, prepared.samples, rows, self._decode)
        except Exception:
            log.exception("sample tables failed at step %d; off for the rest of the run", step)
            self.samples_on = False
            return None

    def evaluation(self, result: EvalResult) -> None:
        """Log one evaluation's figures (``eval/SET[/ENV]/METRIC``) at the step it started."""
        from learner.evaluation import tracker_scalars

        scalars = tracker_scalars(result)
        self._each(result.step, lambda b: b.log_scalars(result.step, scalars))

    def skip(self, record: SkipRecord) -> None:
        """Count a batch that trained nothing, with what its groups scored (logged at the
        steps done so far: ``batch/skipped_*``, apart from the steps' own charts)."""
        self.skipped += 1
        step = record.step
        scalars = {
            "batch/skipped_batches": float(self.skipped),
            "batch/skipped_reward_mean": record.reward_mean,
            "batch/skipped_zero_variance": float(record.zero_variance),
        }
        if record.zero_variance_reward is not None:
            scalars["batch/skipped_zero_variance_reward"] = record.zero_variance_reward
        self._each(step, lambda b: b.log_scalars(step, scalars))

    def close(self) -> None:
        """Flush and close every backend still running."""
        for backend in list(self.backends):
            self._guard(backend, "closing", backend.close)
        self.backends.clear()

    def _each(self, step: int, call: Callable[[Backend], None]) -> None:
        for backend in list(self.backends):
            self._guard(backend, f"step {step}", lambda b=backend: call(b))

    def _guard(self, backend: Backend, when: str, call: Callable[[], None]) -> None:
        try:
            call()
        except Exception:
            message = "tracker %s failed at %s; disabled for the rest of the run"
            log.exception(message, backend.name, when)
            self.backends.remove(backend)


def missing_packages(cfg: TrackingConfig) -> list[str]:
    """The packages of the named trackers that are not installed."""
    names = [PACKAGES[kind] for kind in cfg.tracker]
    return [name for name in names if importlib.util.find_spec(name) is None]


def tokenizer_decoder(model: Path) -> Callable[[], Decode]:
    """A loader of the run's tokenizer (from the model directory) as a `Decode`."""

    def load() -> Decode:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model)
        return lambda ids: tokenizer.decode(list(ids), skip_special_tokens=False)

    return load


def open_tracker(cfg: TrackingConfig, run: str, config: Mapping[str, Any], model: Path) -> Tracker:
    """The backends `cfg` names, opened; `config` is the masked run config they record.
    A backend that cannot open is logged and left out."""
    name = cfg.tracker_run_name or run
    backends: list[Backend] = []
    for kind in cfg.tracker:
        try:
            if kind is TrackerKind.TENSORBOARD:
                from learner.tracking.tensorboard_backend import TensorBoardBackend

                backends.append(TensorBoardBackend(cfg, name, config))
            else:
                from learner.tracking.wandb_backend import WandbBackend

                backends.append(WandbBackend(cfg, name, config))
        except Exception:
            log.exception("tracker %s could not start; the run goes on without it", kind)
    return Tracker(backends, cfg, tokenizer_decoder(model))
