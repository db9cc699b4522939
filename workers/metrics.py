"""Prometheus metrics of the rollout workers, on the default registry.

Canonical names (HELPERS.md) are exported exactly; `farm_worker_sandbox_seconds` and
`farm_worker_episode_retries_total` are additions.
"""

from __future__ import annotations

import functools

from prometheus_client import Counter, Gauge, Histogram

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
_LAG_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)

EPISODES = Counter(
    "farm_worker_episodes_total", "Episodes finished, by env and outcome", ["env", "outcome"]
)
ENV_STEPS = Counter("farm_worker_env_steps_total", "Environment steps taken", ["env"])
TOKENS_GENERATED = Counter("farm_worker_tokens_generated_total", "Completion tokens sampled")
GROUPS_PUBLISHED = Counter("farm_worker_groups_published_total", "Trajectory groups published")
INFERENCE_LATENCY = Histogram(
    "farm_worker_inference_latency_seconds",
    "Latency of one generate call",
    buckets=_LATENCY_BUCKETS,
)
ENV_STEP_SECONDS = Histogram(
    "farm_worker_env_step_seconds", "Latency of one env reset/step", buckets=_LATENCY_BUCKETS
)
SANDBOX_SECONDS = Histogram(
    "farm_worker_sandbox_seconds",
    "Env step time of environments backed by a sandbox pool",
    buckets=_LATENCY_BUCKETS,
)
ERRORS = Counter("farm_worker_errors_total", "Episode errors by category", ["category"])
RETRIES = Counter(
    "farm_worker_episode_retries_total",
    "Episodes re-run after an infrastructure fault",
    ["category"],
)
REWARD_COMPONENTS = Histogram(
    "farm_worker_reward_component",
    "Named components of reward-function rewards (envs.rewards), per env",
    ["env", "component"],
    buckets=(-1.0, -0.5, 0.0, 0.25, 0.5, 0.75, 1.0, 2.0, 5.0),
)
MAX_COMPONENTS = 32  # distinct component names per env; more are counted as "other"
EPISODES_IN_FLIGHT = Gauge("farm_worker_episodes_in_flight", "Episodes running now")
TASKS_IN_PROGRESS = Gauge("farm_worker_tasks_in_progress", "Tasks read and not yet committed")
EVENT_LOOP_LAG = Histogram(
    "farm_worker_event_loop_lag_seconds", "Event-loop scheduling lag", buckets=_LAG_BUCKETS
)


# labels() resolves a child under a lock on every call; episodes resolve theirs once.
@functools.lru_cache(maxsize=1024)
def env_steps(env: str) -> Counter:
    return ENV_STEPS.labels(env=env)


@functools.lru_cache(maxsize=4096)
def episodes(env: str, outcome: str) -> Counter:
    return EPISODES.labels(env=env, outcome=outcome)


_components: dict[str, set[str]] = {}


def observe_reward_components(env: str, components: object) -> None:
    """Observe each named component of one step's reward (its sum and count give the mean)."""
    if not isinstance(components, dict):
        return
    seen = _components.setdefault(env, set())
    for name, value in components.items():
        if not isinstance(value, int | float):
            continue
        key = str(name)
        if key not in seen:
            if len(seen) >= MAX_COMPONENTS:
                key = "other"  # a reward function that names parts per row must not flood
            seen.add(key)
        REWARD_COMPONENTS.labels(env=env, component=key).observe(float(value))
