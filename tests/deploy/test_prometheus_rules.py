"""Prometheus files in deploy/prometheus: rules and configs pass promtool, alerts behave.

`promtool test rules` runs the unit tests in deploy/prometheus/tests, which feed
each alert series that must fire it and series that must not.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.conftest import require
from tests.deploy.promql import ALERTS, DEPLOY

PROM = DEPLOY / "prometheus"
REQUIRED_ALERTS = {
    "FarmLearnerStalled",
    "FarmStreamLagGrowing",
    "FarmDeadLettersRising",
    "FarmServerStaleWeights",
    "FarmSandboxPoolExhausted",
    "FarmSamplerLearnerMismatch",
    "FarmPolicyMassLeavingSupport",
    "FarmPolicyCollapsed",
    "FarmNothingToTrain",
}


def _promtool(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    require(shutil.which("promtool") is not None, "promtool (Debian package prometheus)")
    return subprocess.run(["promtool", *args], capture_output=True, text=True, timeout=60, cwd=cwd)


def test_alert_rules_pass_promtool_check() -> None:
    result = _promtool("check", "rules", str(ALERTS))
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_required_alert_exists_with_severity_and_summary() -> None:
    rules = [r for g in yaml.safe_load(ALERTS.read_text())["groups"] for r in g["rules"]]
    assert {r["alert"] for r in rules} == REQUIRED_ALERTS
    for rule in rules:
        assert rule["labels"]["severity"] in ("warning", "critical"), rule["alert"]
        assert rule["annotations"]["summary"], rule["alert"]


def test_alerts_fire_and_stay_silent_as_specified() -> None:
    tests = PROM / "tests" / "alerts_test.yml"
    result = _promtool("test", "rules", str(tests))
    assert result.returncode == 0, result.stdout + result.stderr
    tested = {
        t["alertname"]
        for c in yaml.safe_load(tests.read_text())["tests"]
        for t in c["alert_rule_test"]
    }
    assert tested == REQUIRED_ALERTS, "every alert needs a unit test"


@pytest.mark.parametrize("config", ["prometheus.yml", "prometheus-k8s.yml"])
def test_scrape_configs_pass_promtool_check(config: str, tmp_path: Path) -> None:
    """The configs name the rules at their in-container path; check them against our file.

    Debian builds Prometheus without Kubernetes service discovery, so its promtool
    rejects `kubernetes_sd_configs`; that block is swapped for a static target and
    the rest (relabelling included) is still checked.
    """
    doc = yaml.safe_load((PROM / config).read_text())
    assert doc["rule_files"] == ["/etc/prometheus/alerts.yml"]
    doc["rule_files"] = [str(ALERTS)]
    for job in doc["scrape_configs"]:
        if "kubernetes_sd_configs" in job:
            assert job["kubernetes_sd_configs"][0]["role"] == "pod"
            del job["kubernetes_sd_configs"]
            job["static_configs"] = [{"targets": ["127.0.0.1:9101"]}]
    path = tmp_path / config
    path.write_text(yaml.safe_dump(doc))
    result = _promtool("check", "config", str(path))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS: 1 rule files found" in result.stdout


def test_compose_scrape_jobs_match_compose_services_and_ports() -> None:
    compose = yaml.safe_load((DEPLOY / "compose" / "docker-compose.yml").read_text())
    services = compose["services"]
    aliases = {
        alias
        for svc in services.values()
        for net in (svc.get("networks") or {}).values()
        for alias in (net or {}).get("aliases", [])
    }
    doc = yaml.safe_load((PROM / "prometheus.yml").read_text())
    for job in doc["scrape_configs"]:
        for sd in job["dns_sd_configs"]:
            for name in sd["names"]:
                assert name in services or name in aliases, f"{job['job_name']}: no service {name}"
                ports = [c for n, s in services.items() if n == name for c in s.get("command", [])]
                if ports:
                    assert str(sd["port"]) in ports, (
                        f"{name} does not serve metrics on {sd['port']}"
                    )


def test_every_alert_is_documented_in_monitoring_md() -> None:
    """docs/monitoring.md's alert table names every rule of alerts.yml (issue 42: it had 5 of 7)."""
    rules = [r for g in yaml.safe_load(ALERTS.read_text())["groups"] for r in g["rules"]]
    table = (DEPLOY.parent / "docs" / "monitoring.md").read_text()
    missing = [r["alert"] for r in rules if f"| `{r['alert']}` |" not in table]
    assert not missing, f"alerts missing from docs/monitoring.md's table: {missing}"
