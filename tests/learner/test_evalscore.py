"""Eval scoring against hand-computed values: the unbiased pass@k, mean@k, mixes, infra rows."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest

from broker.messages import ErrorCategory, EvalMark, TrajectoryGroup
from learner.evalscore import pass_at_k, score, score_sets
from tests.learner.factories import make_group


@pytest.mark.parametrize(
    ("n", "c", "k", "expected"),
    [
        (5, 2, 2, 1 - 3 / 10),  # 1 - C(3,2)/C(5,2)
        (4, 1, 1, 0.25),  # pass@1 is the pass rate
        (10, 0, 3, 0.0),
        (3, 2, 2, 1.0),  # n - c < k: every draw of k holds a pass
        (10, 3, 5, 1 - 21 / 252),  # 1 - C(7,5)/C(10,5)
        (8, 8, 8, 1.0),
        (8, 1, 8, 1.0),
    ],
)
def test_pass_at_k_matches_hand_values(n: int, c: int, k: int, expected: float) -> None:
    assert math.isclose(pass_at_k(n, c, k), expected, rel_tol=1e-12)


@pytest.mark.parametrize(("n", "c", "k"), [(3, 4, 1), (3, 1, 0), (3, 1, 4), (0, 0, 1)])
def test_pass_at_k_refuses_impossible_counts(n: int, c: int, k: int) -> None:
    with pytest.raises(ValueError, match="pass@k"):
        pass_at_k(n, c, k)


def _eval_group(gid: str, rewards: list[float], row: int, **kw: object) -> TrajectoryGroup:
    group = make_group(gid, rewards, **kw)  # type: ignore[arg-type]
    task = dataclasses.replace(group.task, eval=EvalMark("held", "r1", row))
    return dataclasses.replace(group, task=task)


def test_score_per_set_and_env_leaves_infra_rows_out() -> None:
    groups = [
        _eval_group("a", [1.0, 0.0, 0.0, 0.0], 0),  # c=1 of 4
        _eval_group("b", [1.0, 1.0, 0.0, 1.0], 1),  # c=3 of 4
        _eval_group("c", [0.0, 0.0, 0.0, 0.0], 2, error=ErrorCategory.INFERENCE),
    ]
    figures = score(groups, k=2, threshold=0.5)
    assert figures["rows"] == 3 and figures["scored_rows"] == 2
    assert figures["infra_failed_rows"] == 1
    assert math.isclose(figures["mean_at_k"], 4 / 8)
    assert math.isclose(figures["pass_at_1"], (1 / 4 + 3 / 4) / 2)
    # pass@2: 1 - C(3,2)/C(4,2) = 0.5 and 1 - C(1,2)/C(4,2) = 1
    assert math.isclose(figures["pass_at_2"], (0.5 + 1.0) / 2)
    assert figures["turns_mean"] == 1.0 and figures["tokens_mean"] > 0
    assert figures["multi_turn"] == 0.0
    assert sum(v for k, v in figures.items() if k.startswith("finish/")) == pytest.approx(1.0)
    per = score_sets(groups, 2, 0.5)
    assert set(per) == {"held", "held/toy"} and per["held"] == per["held/toy"]


def test_multi_turn_is_the_share_of_episodes_past_their_first_turn() -> None:
    """In `calc` a turn without a call ends the episode: this share is its tool-call rate."""
    one = _eval_group("a", [0.0, 0.0, 0.0, 0.0], 0)
    two = _eval_group("b", [1.0, 0.0, 1.0, 0.0], 1, turns=2)
    figures = score([one, two, one], k=2, threshold=0.5)
    assert math.isclose(figures["multi_turn"], 4 / 12)
    assert math.isclose(figures["turns_mean"], 16 / 12)


def test_report_writes_the_log_line_the_gauges_and_the_json(tmp_path, caplog) -> None:
    from prometheus_client import REGISTRY

    from learner.evaluation import EvalResult, report, tracker_scalars

    result = EvalResult(
        step=6,
        version=5,
        seconds=1.5,
        tasks=2,
        missing_rows=0,
        weight_versions=(4, 5),
        sets={"held": {"pass_at_1": 0.25}},
    )
    with caplog.at_level("INFO", logger="learner"):
        report(result, tmp_path)
    assert any('"event": "eval"' in r.getMessage() for r in caplog.records)
    labels = {"set": "held", "metric": "pass_at_1"}
    assert REGISTRY.get_sample_value("farm_learner_eval_score", labels) == 0.25
    assert REGISTRY.get_sample_value("farm_learner_eval_step") == 6
    assert json.loads((tmp_path / "eval-000006.json").read_text())["sets"] == result.sets
    assert tracker_scalars(result) == {"eval/held/pass_at_1": 0.25}
