"""Prometheus metrics of the sandbox pool, on the default registry.

Names are the canonical ones that deploy/ dashboards reference. Container states
are a gauge per state, refreshed by the pool whenever a sandbox changes state.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

CONTAINERS = Gauge(
    "farm_sandbox_containers",
    "Sandboxes (containers or bwrap jails) by state.",
    ["state"],
)
SESSIONS_ACTIVE = Gauge("farm_sandbox_sessions_active", "Sandbox sessions currently open.")
ACQUIRE_SECONDS = Histogram(
    "farm_sandbox_acquire_seconds",
    "Time to acquire a session (waiting for a slot and opening it).",
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
)
RUN_SECONDS = Histogram(
    "farm_sandbox_run_seconds",
    "Round-trip time of one run / run_python call.",
    buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
)
VIOLATIONS = Counter(
    "farm_sandbox_violations_total", "Calls that ran into a limit, by kind.", ["kind"]
)
RECYCLED = Counter(
    "farm_sandbox_containers_recycled_total",
    "Sandboxes removed after N sessions, a violation or a failed health check.",
)
STATES = ("starting", "idle", "busy", "recycling")
