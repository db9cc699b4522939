"""Prometheus metrics of the inference package (server, client and weight sync), on the default registry.

Names follow HELPERS.md's canonical list; the deploy/ dashboards reference exactly these.
Additions beyond the list: `farm_inference_running_sequences`, `farm_inference_waiting_requests`,
`farm_inference_weight_reload_seconds`, and the prefix cache's `farm_inference_prefix_cache_*`
(hit rate: `rate(..._hit_tokens_total) / rate(..._queried_tokens_total)`).
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

# --- CPU policy server -------------------------------------------------------------------------
REQUESTS = Counter(
    "farm_inference_requests_total",
    "HTTP requests answered by the policy server",
    ["route", "code"],
)
TOKENS_GENERATED = Counter("farm_inference_tokens_generated_total", "Tokens sampled by the server")
BATCH_SIZE = Histogram(
    "farm_inference_batch_size",
    "Sequences per forward pass",
    buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256),
)
REQUEST_SECONDS = Histogram(
    "farm_inference_request_seconds",
    "Wall time of a /v1/completions request",
    buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120),
)
WEIGHT_VERSION = Gauge(
    "farm_inference_weight_version", "Weight version served (-1 when the label is not an integer)"
)
PAUSED = Gauge("farm_inference_paused", "1 while generation is paused")
RUNNING = Gauge("farm_inference_running_sequences", "Sequences in the running batch")
WAITING = Gauge(
    "farm_inference_waiting_requests", "Requests queued (not yet admitted or held by a pause)"
)
RELOAD_SECONDS = Histogram(
    "farm_inference_weight_reload_seconds",
    "Time to load new weights from disk into the model",
    buckets=(0.01, 0.05, 0.1, 0.5, 1, 5, 10, 30, 60),
)
PREFIX_QUERIED = Counter(
    "farm_inference_prefix_cache_queried_tokens",
    "Prompt tokens looked up in the prefix cache",
)
PREFIX_HITS = Counter(
    "farm_inference_prefix_cache_hit_tokens",
    "Prompt tokens whose KV came from the prefix cache (not prefilled)",
)
PREFIX_EVICTED = Counter(
    "farm_inference_prefix_cache_evicted_blocks",
    "KV blocks evicted from the prefix cache to stay within --kv-cache-mb",
)
PREFIX_BYTES = Gauge(
    "farm_inference_prefix_cache_size_bytes", "Bytes of KV held by the prefix cache"
)
PREFIX_BLOCKS = Gauge("farm_inference_prefix_cache_blocks", "KV blocks held by the prefix cache")

# --- generation client -------------------------------------------------------------------------
CLIENT_REQUESTS = Counter(
    "farm_inference_client_requests_total",
    "Completion calls by server and outcome (ok, abort, bad_request, error, timeout)",
    ["server", "outcome"],
)
CLIENT_LATENCY = Histogram(
    "farm_inference_client_latency_seconds",
    "Latency of one completion call to one server",
    ["server"],
    buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120),
)
CLIENT_OUTSTANDING = Gauge(
    "farm_inference_client_outstanding", "Completion calls in flight", ["server"]
)
CLIENT_HEALTHY = Gauge(
    "farm_inference_client_server_healthy", "1 if the last health check passed", ["server"]
)

# --- weight sync -------------------------------------------------------------------------------
SYNC_SERVED_VERSION = Gauge(
    "farm_weight_sync_served_version", "Weight version verified via /weight_info", ["server"]
)
SYNC_FAILURES = Counter(
    "farm_weight_sync_failures_total",
    "Failed attempts to move a server to a new version",
    ["server"],
)
