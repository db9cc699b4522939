"""Prometheus metrics of the farm supervisor (served on its own `/metrics`).

They tell an operator which children are up and how often each was restarted;
the children's own metrics are served by the children.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge

CHILD_UP = Gauge("farm_supervisor_child_up", "1 while the child process runs.", ["process"])
RESTARTS = Counter(
    "farm_supervisor_restarts_total", "Times a crashed child was restarted.", ["process"]
)
