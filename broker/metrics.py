"""Prometheus metrics of the broker: traffic counters and stream gauges.

Counters are bumped where the traffic happens; the gauges (length, lag,
pending, admission) are refreshed by `refresh_stream_gauges`, which any
long-running role calls periodically.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge

PUBLISHED = Counter("farm_broker_published_total", "Entries appended to a stream.", ["stream"])
CONSUMED = Counter(
    "farm_broker_consumed_total", "Entries delivered to a consumer.", ["stream", "group"]
)
ACKED = Counter("farm_broker_acked_total", "Entries acknowledged.", ["stream", "group"])
RECLAIMED = Counter(
    "farm_broker_reclaimed_total",
    "Entries claimed from idle (dead) consumers.",
    ["stream", "group"],
)
DEADLETTERED = Counter(
    "farm_broker_deadlettered_total", "Entries moved to the dead-letter stream.", ["stream"]
)
DUPLICATES = Counter(
    "farm_broker_duplicates_total",
    "Entries dropped because their message id was already committed.",
    ["stream", "group"],
)
STREAM_LENGTH = Gauge("farm_stream_length_entries", "Entries in a stream.", ["stream"])
STREAM_LAG = Gauge(
    "farm_stream_lag_entries", "Entries not yet delivered to a group.", ["stream", "group"]
)
STREAM_PENDING = Gauge(
    "farm_stream_pending_entries", "Entries delivered but not acked.", ["stream", "group"]
)
ADMISSION_IN_FLIGHT = Gauge("farm_admission_in_flight", "Tasks admitted and not yet released.")
ADMISSION_LIMIT = Gauge("farm_admission_limit", "Admission budget limit.")
ADMISSION_HELD = Gauge(
    "farm_admission_held",
    "1 while admission is held at one batch because a stream is over its bounds.",
)
STREAM_BYTES = Gauge(
    "farm_stream_bytes", "Memory a stream takes in Redis (MEMORY USAGE).", ["stream"]
)
STREAM_OVER = Gauge(
    "farm_stream_over_bounds",
    "1 while a stream holds more unacknowledged bytes or entries than its bounds.",
    ["stream"],
)
TRIMMED = Counter(
    "farm_broker_trimmed_total",
    "Entries trimmed: acknowledged by every group (work streams), or the oldest beyond the "
    "bounds (dead letters, policy events).",
    ["stream"],
)
