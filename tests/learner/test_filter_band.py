"""`learner filter`'s band (`learner.evaluate.kept_rows`) on groups of known pass rates: both
ends inclusive, a zero-width band keeps exactly its rate, spoiled or missing groups are left out
and counted, and a dataset-of-prompts row comes back with a `pass_rate` column. The farm path
of the filter (workers, the CPU server, `python -m learner filter`) is tests/learner/
test_eval_farm.py; the band's edges are here, where they cost no farm start-up."""

from __future__ import annotations

import numpy as np
import pytest

from broker.messages import ErrorCategory, FinishReason, Task, Trajectory, TrajectoryGroup, Turn
from learner.datasets import TaskRow
from learner.evaluate import kept_rows

RATES = [(0, 4), (1, 4), (2, 4), (3, 4), (4, 4)]


def _turn(reward: float) -> Turn:
    ids = np.zeros(1, np.int32)
    return Turn(ids, ids, np.zeros(1, np.float32), 0, reward, True, False)


def _group(index: int, passes: int, of: int, error: ErrorCategory | None = None) -> TrajectoryGroup:
    task = Task(f"t{index}", "ev-rate@{}", of, index, 0)
    trajectories = tuple(
        Trajectory((_turn(1.0 if i < passes else 0.0),), FinishReason.TERMINATED, sample_index=i)
        for i in range(of)
    )
    if error is not None:
        trajectories = (
            Trajectory((), FinishReason.ERROR, error=error),
            *trajectories[1:],
        )
    return TrajectoryGroup(f"t{index}", task, trajectories, "w0")


ROWS = [TaskRow(f'ev-rate@{{"passes": {p}}}') for p, _ in RATES]
GROUPS = {i: _group(i, p, n) for i, (p, n) in enumerate(RATES)}


@pytest.mark.parametrize(
    ("band", "kept"),
    [
        ((0.1, 0.9), [1, 2, 3]),
        ((0.0, 0.0), [0]),
        ((0.5, 1.0), [2, 3, 4]),
        ((0.25, 0.75), [1, 2, 3]),
    ],
)
def test_the_band_keeps_its_rates_with_both_ends(
    band: tuple[float, float], kept: list[int]
) -> None:
    lines, unscored = kept_rows(ROWS, GROUPS, band, threshold=0.5)
    assert unscored == 0
    assert [line["env_spec"] for line in lines] == [ROWS[i].env_spec for i in kept]
    assert [line["meta"]["pass_rate"] for line in lines] == [RATES[i][0] / 4 for i in kept]


def test_spoiled_and_missing_groups_are_left_out_and_counted() -> None:
    groups = dict(GROUPS)
    groups[1] = _group(1, 1, 4, error=ErrorCategory.INFERENCE)
    del groups[3]
    lines, unscored = kept_rows(ROWS, groups, (0.0, 1.0), threshold=0.5)
    assert unscored == 2
    assert [line["meta"]["pass_rate"] for line in lines] == [0.0, 0.5, 1.0]


def test_a_prompt_row_comes_back_with_a_pass_rate_column() -> None:
    spec = "dataset@{}"
    rows = [TaskRow(spec, row={"question": "1+1", "answer": "2"})]
    lines, _ = kept_rows(rows, {0: _group(0, 3, 4)}, (0.5, 1.0), 0.5, prompt_spec=spec)
    assert lines == [{"question": "1+1", "answer": "2", "pass_rate": 0.75}]
