"""Where the deploy/ files reference metrics: PromQL expressions and the names in them.

Collects every PromQL expression of the alert rules and the Grafana dashboard, and
extracts the metric names (``farm_*``) they use, mapped back to the name a
prometheus-client collector is registered under (histogram ``_bucket``/``_sum``/
``_count`` series belong to the histogram).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
ALERTS = DEPLOY / "prometheus" / "alerts.yml"
DASHBOARDS = sorted((DEPLOY / "grafana" / "dashboards").glob("*.json"))

# A metric name inside PromQL: not preceded by a word char, `$` or `{` label context.
_NAME = re.compile(r"(?<![\w$])(farm_[a-z0-9_]+)")
_SERIES_SUFFIXES = ("_bucket", "_sum", "_count")


def alert_exprs() -> list[str]:
    doc = yaml.safe_load(ALERTS.read_text())
    return [rule["expr"] for group in doc["groups"] for rule in group["rules"]]


def dashboard_exprs() -> list[str]:
    exprs = []
    for path in DASHBOARDS:
        for panel in json.loads(path.read_text())["panels"]:
            exprs.extend(t["expr"] for t in panel.get("targets", []))
    return exprs


def series_names(expr: str) -> set[str]:
    """Series names an expression selects (label values and strings removed first)."""
    without_strings = re.sub(r'"[^"]*"', '""', expr)
    return set(_NAME.findall(without_strings))


def metric_name(series: str, histograms: set[str]) -> str:
    """The registered metric a series belongs to (``x_bucket`` -> ``x`` for histograms)."""
    for suffix in _SERIES_SUFFIXES:
        if series.endswith(suffix) and series[: -len(suffix)] in histograms:
            return series[: -len(suffix)]
    return series
