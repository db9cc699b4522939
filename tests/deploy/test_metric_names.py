"""Every metric the dashboard and the alert rules reference is exported by the code.

Imports every `<package>/metrics.py` of the project (each defines its metrics on
the default registry) and compares the names the deploy/ files use against what
is registered, with prometheus-client's naming: counters are referenced with
`_total`, histograms through their `_bucket`/`_sum`/`_count` series. The
canonical names of HELPERS.md are checked too: each is exported and referenced.
"""

from __future__ import annotations

import importlib

from prometheus_client import REGISTRY

from tests.deploy.promql import ROOT, alert_exprs, dashboard_exprs, metric_name, series_names

CANONICAL = """
farm_broker_published_total farm_broker_consumed_total farm_broker_acked_total
farm_broker_reclaimed_total farm_broker_deadlettered_total farm_broker_duplicates_total
farm_stream_length_entries farm_stream_lag_entries farm_stream_pending_entries
farm_admission_in_flight farm_admission_limit
farm_sandbox_containers farm_sandbox_sessions_active farm_sandbox_acquire_seconds
farm_sandbox_run_seconds farm_sandbox_violations_total farm_sandbox_containers_recycled_total
farm_inference_requests_total farm_inference_tokens_generated_total farm_inference_batch_size
farm_inference_request_seconds farm_inference_weight_version farm_inference_paused
farm_inference_client_requests_total farm_inference_client_latency_seconds
farm_inference_client_outstanding farm_inference_client_server_healthy
farm_weight_sync_served_version farm_weight_sync_failures_total
farm_worker_episodes_total farm_worker_env_steps_total farm_worker_tokens_generated_total
farm_worker_groups_published_total farm_worker_inference_latency_seconds
farm_worker_env_step_seconds farm_worker_errors_total farm_worker_episodes_in_flight
farm_worker_event_loop_lag_seconds farm_worker_tasks_in_progress
farm_learner_steps_total farm_learner_step_seconds farm_learner_wait_seconds
farm_learner_samples_total farm_learner_loss farm_learner_reward_mean
farm_learner_clip_fraction farm_learner_entropy farm_learner_policy_version
farm_learner_staleness_steps farm_learner_stale_groups_total
farm_learner_zero_variance_groups_total farm_learner_weight_push_seconds
farm_learner_last_step_timestamp_seconds farm_learner_tasks_issued_total
""".split()


def _exported() -> tuple[set[str], set[str]]:
    """(names as PromQL references them, histogram names) over every metrics module."""
    for module in sorted(p.parent.name for p in ROOT.glob("*/metrics.py")):
        importlib.import_module(f"{module}.metrics")
    names, histograms = set(), set()
    for family in REGISTRY.collect():
        if not family.name.startswith("farm_"):
            continue
        names.add(family.name + "_total" if family.type == "counter" else family.name)
        if family.type == "histogram":
            histograms.add(family.name)
    return names, histograms


def _referenced(histograms: set[str]) -> set[str]:
    return {
        metric_name(series, histograms)
        for expr in [*alert_exprs(), *dashboard_exprs()]
        for series in series_names(expr)
    }


def test_every_referenced_metric_is_exported() -> None:
    exported, histograms = _exported()
    missing = _referenced(histograms) - exported
    assert not missing, f"deploy/ references metrics nobody exports: {sorted(missing)}"


def test_every_canonical_metric_is_exported() -> None:
    exported, _ = _exported()
    missing = set(CANONICAL) - exported
    assert not missing, f"canonical metrics not exported: {sorted(missing)}"


def test_every_canonical_metric_is_on_the_dashboard_or_an_alert() -> None:
    _, histograms = _exported()
    unused = set(CANONICAL) - _referenced(histograms)
    assert not unused, f"canonical metrics nobody watches: {sorted(unused)}"


def test_extraction_sees_through_labels_and_histogram_series() -> None:
    expr = 'sum(rate(farm_a_seconds_bucket{stream="farm_not_a_metric"}[1m])) / farm_b_total'
    assert series_names(expr) == {"farm_a_seconds_bucket", "farm_b_total"}
    assert metric_name("farm_a_seconds_bucket", {"farm_a_seconds"}) == "farm_a_seconds"
    assert metric_name("farm_a_seconds_bucket", set()) == "farm_a_seconds_bucket"
