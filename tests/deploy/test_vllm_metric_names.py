"""Every `vllm:*` series the dashboard queries is one vLLM 0.33 exports.

vLLM defines its Prometheus metrics with prometheus-client in `vllm/v1/metrics/loggers.py`
(`self._gauge_cls(name="vllm:...")`, `_counter_cls`, `_histogram_cls`). The names are read
from that file of the unpacked 0.33 wheel (tests/inference/vllm_contract/env.py; the
bootstrap builds it) with the kind of each, and the dashboard's series are checked with
prometheus-client's naming: a counter is queried as `_total`, a histogram through its
`_bucket`/`_sum`/`_count` series, a gauge by its own name.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from tests.conftest import require
from tests.deploy.promql import DASHBOARDS, dashboard_exprs
from tests.inference.vllm_contract.env import default_dir

_DEFINED = re.compile(r"_(gauge|counter|histogram)_cls\(\s*name=\"(vllm:[a-z0-9_:]+)\"")
_SERIES = re.compile(r"(?<![\w$])(vllm:[a-z0-9_:]+)")
_PANELS = ("queue", "KV-cache", "tokens", "time to first token")  # what the issue asked for


def _loggers() -> Path:
    path = default_dir() / "vllm" / "v1" / "metrics" / "loggers.py"
    require(path.is_file(), f"vLLM 0.33's source at {path} (scripts/bootstrap.sh unpacks it)")
    return path


def exported_series(source: str) -> set[str]:
    """The series names prometheus-client exposes for the metrics `source` defines."""
    out: set[str] = set()
    for kind, name in _DEFINED.findall(source):
        if kind == "gauge":
            out.add(name)
        elif kind == "counter":
            out.add(f"{name}_total")
        else:
            out.update(f"{name}{suffix}" for suffix in ("_bucket", "_sum", "_count"))
    return out


def test_every_vllm_series_on_the_dashboard_is_exported_by_vllm_0_33() -> None:
    exported = exported_series(_loggers().read_text())
    # the parse found vLLM's metrics (a changed layout would make every name "missing")
    assert {"vllm:num_requests_waiting", "vllm:generation_tokens_total"} <= exported
    used = {s for expr in dashboard_exprs() for s in _SERIES.findall(re.sub(r'"[^"]*"', "", expr))}
    assert len(used) >= 4, f"the dashboard queries too few vLLM series: {sorted(used)}"
    missing = used - exported
    assert not missing, f"vLLM 0.33 exports no {sorted(missing)}"


def test_the_dashboard_has_the_vllm_panels() -> None:
    titles = [
        p["title"]
        for path in DASHBOARDS
        for p in json.loads(path.read_text())["panels"]
        if any("vllm:" in t["expr"] for t in p.get("targets", []))
    ]
    for want in _PANELS:
        assert any(want in title for title in titles), f"no vLLM panel for {want}: {titles}"


def test_a_misspelt_or_mistyped_name_is_caught() -> None:
    source = _loggers().read_text()
    exported = exported_series(source)
    assert "vllm:num_requests_waiting_total" not in exported  # a gauge has no _total
    assert "vllm:time_to_first_token_seconds" not in exported  # a histogram: _bucket etc.
    assert "vllm:kv_cache_usage_percent" not in exported
