"""The Grafana dashboard and its provisioning: structure, datasource wiring, valid PromQL.

PromQL syntax is checked by Debian's promtool: every dashboard expression becomes a
recording rule in a temporary rules file that `promtool check rules` must accept.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import yaml

from tests.conftest import require
from tests.deploy.promql import DASHBOARDS, DEPLOY, dashboard_exprs

PROVISIONING = DEPLOY / "grafana" / "provisioning"
COVERAGE = {
    "throughput": "farm_worker_episodes_total",
    "tokens": "farm_worker_tokens_generated_total",
    "lag": "farm_stream_lag_entries",
    "staleness": "farm_learner_staleness_steps_bucket",
    "rewards": "farm_learner_reward_mean",
    "sandbox": "farm_sandbox_containers",
    "inference latency": "farm_inference_request_seconds_bucket",
    "weight version": "farm_weight_sync_served_version",
}


def _dashboard() -> dict:
    assert len(DASHBOARDS) == 1, DASHBOARDS
    return json.loads(DASHBOARDS[0].read_text())


def test_dashboard_panels_are_well_formed() -> None:
    dash = _dashboard()
    assert dash["uid"] == "rollout-farm"
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for panel in dash["panels"]:
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= 24, panel["title"]
        if panel["type"] == "row":
            continue
        assert panel["targets"], f"panel {panel['title']!r} has no query"
        ref_ids = [t["refId"] for t in panel["targets"]]
        assert len(ref_ids) == len(set(ref_ids)), panel["title"]


def test_dashboard_covers_every_area() -> None:
    exprs = "\n".join(dashboard_exprs())
    missing = {area: name for area, name in COVERAGE.items() if name not in exprs}
    assert not missing, f"dashboard lacks panels for {missing}"


def test_dashboard_uses_the_provisioned_datasource() -> None:
    datasources = yaml.safe_load((PROVISIONING / "datasources" / "prometheus.yml").read_text())
    uids = {d["uid"] for d in datasources["datasources"] if d["type"] == "prometheus"}
    for panel in _dashboard()["panels"]:
        for target in [panel, *panel.get("targets", [])]:
            if "datasource" in target:
                assert target["datasource"]["uid"] in uids, panel["title"]


def test_dashboard_provider_points_where_compose_mounts_the_dashboards() -> None:
    provider = yaml.safe_load((PROVISIONING / "dashboards" / "farm.yml").read_text())
    path = provider["providers"][0]["options"]["path"]
    compose = yaml.safe_load((DEPLOY / "compose" / "docker-compose.yml").read_text())
    mounts = compose["services"]["grafana"]["volumes"]
    assert f"../grafana/dashboards:{path}:ro" in mounts
    assert "../grafana/provisioning:/etc/grafana/provisioning:ro" in mounts


def test_dashboard_promql_parses(tmp_path: Path) -> None:
    require(shutil.which("promtool") is not None, "promtool (Debian package prometheus)")
    rules = [
        {"record": f"farm:dashboard_expr_{i}", "expr": e} for i, e in enumerate(dashboard_exprs())
    ]
    path = tmp_path / "dashboard_rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    result = subprocess.run(
        ["promtool", "check", "rules", str(path)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(rules)} rules found" in result.stdout


def test_a_broken_expression_is_caught(tmp_path: Path) -> None:
    """The PromQL check above can fail: promtool rejects a malformed expression."""
    require(shutil.which("promtool") is not None, "promtool (Debian package prometheus)")
    path = tmp_path / "bad.yml"
    bad = {"record": "farm:bad", "expr": "sum(rate(farm_worker_episodes_total[1m])"}
    path.write_text(yaml.safe_dump({"groups": [{"name": "bad", "rules": [bad]}]}))
    result = subprocess.run(
        ["promtool", "check", "rules", str(path)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode != 0
