"""What the farm is doing right now, read from the children's /metrics and from Redis.

`FarmView.poll()` scrapes every child's Prometheus endpoint (each scrape bounded by
a timeout; a child that does not answer is left out of that poll) and reads the
run's streams, admission budget and policy version from Redis through the broker's
own `run_state`. It turns counters into rates between two polls and returns a
`FarmStatus`: among them the share of the learner's groups that had zero variance in the
period, with their common reward ("all 1.0: solved"), and the lines of an evaluation
finished since the last poll (one per set). It also keeps the learner's reward per optimizer step, which
`farm demo` plots at the end.
"""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import redis.asyncio as aioredis
from prometheus_client.parser import text_string_to_metric_families

from broker.errors import BrokerError
from broker.keys import LEARNER_GROUP, WORKERS_GROUP, RunKeys
from broker.status import RunState, eval_lines, run_state
from learner.progress import common_reward_text

Samples = dict[str, list[tuple[dict[str, str], float]]]


@dataclass(frozen=True)
class FarmStatus:
    """One observation of the farm; None where no process reported the number."""

    elapsed_s: float
    learner_step: int | None = None
    reward: float | None = None
    episodes_per_s: float | None = None
    tokens_per_s: float | None = None
    staleness_mean: float | None = None
    policy_version: int | None = None
    served_versions: tuple[int, ...] = ()
    sandbox: Mapping[str, int] = field(default_factory=dict)
    tasks_lag: int | None = None
    tasks_pending: int | None = None
    trajectories_lag: int | None = None
    dead_letters: int | None = None
    latest_dead_letter: str | None = None  # where the newest dead letter came from, and why
    admission: tuple[int, int] | None = None
    zero_variance_share: float | None = None  # of the groups the learner took since the last poll
    zero_variance_reward: float | None = None  # their mean common reward
    new_eval: tuple[str, ...] = ()  # one line per set of an evaluation first seen in this poll

    def line(self) -> str:
        parts = [f"t={self.elapsed_s:5.0f}s", f"step {_fmt(self.learner_step)}"]
        parts.append(f"reward {_fmt(self.reward, '.3f')}")
        if self.zero_variance_share is not None:
            zero = f"zero-var {self.zero_variance_share:.0%}"
            if self.zero_variance_reward is not None:
                zero += f" ({common_reward_text(self.zero_variance_reward)})"
            parts.append(zero)
        parts.append(f"eps/s {_fmt(self.episodes_per_s, '.2f')}")
        parts.append(f"tok/s {_fmt(self.tokens_per_s, '.0f')}")
        parts.append(f"lag tasks {_fmt(self.tasks_lag)}/traj {_fmt(self.trajectories_lag)}")
        parts.append(f"pending {_fmt(self.tasks_pending)}")
        parts.append(f"stale {_fmt(self.staleness_mean, '.2f')}")
        served = ",".join(str(v) for v in self.served_versions) or "-"
        parts.append(f"version {_fmt(self.policy_version)} (served {served})")
        if self.sandbox:
            parts.append("sandbox " + " ".join(f"{k}={v}" for k, v in sorted(self.sandbox.items())))
        if self.admission:
            parts.append(f"admission {self.admission[0]}/{self.admission[1]}")
        dead = f"dead {_fmt(self.dead_letters)}"
        if self.latest_dead_letter:
            dead += f" (latest: {_clip(self.latest_dead_letter, 160)})"
        parts.append(dead)
        return " | ".join(parts)


def _clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _fmt(value: float | None, spec: str = "") -> str:
    return "-" if value is None else format(value, spec)


def parse_metrics(text: str) -> Samples:
    """Sample name -> [(labels, value)] of one exposition text."""
    samples: Samples = defaultdict(list)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[sample.name].append((dict(sample.labels), float(sample.value)))
    return samples


def total(samples: Samples, name: str, **match: str) -> float | None:
    """Sum of a sample over every process and label set matching `match`."""
    values = [v for labels, v in samples.get(name, []) if _matches(labels, match)]
    return sum(values) if values else None


def _matches(labels: Mapping[str, str], match: Mapping[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in match.items())


class FarmView:
    """Polls the farm; holds the previous poll to compute rates."""

    def __init__(
        self,
        metrics_urls: Mapping[str, str],
        redis: aioredis.Redis | None,
        keys: RunKeys,
        timeout_s: float = 2.0,
    ) -> None:
        self.metrics_urls = dict(metrics_urls)
        self.redis = redis
        self.keys = keys
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self.started = time.monotonic()
        self.reward_history: list[tuple[int, float, float]] = []  # (step, reward, elapsed_s)
        self._previous: tuple[float, dict[str, float]] | None = None
        self._eval_seen: dict[str, Any] | None = None
        self._session: aiohttp.ClientSession | None = None

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def scrape(self) -> Samples:
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=self.timeout)
        session = self._session
        names = list(self.metrics_urls)
        texts = await asyncio.gather(*(self._fetch(session, self.metrics_urls[n]) for n in names))
        merged: Samples = defaultdict(list)
        for name, text in zip(names, texts, strict=True):
            if text is None:
                continue
            for sample, values in parse_metrics(text).items():
                merged[sample].extend(({**labels, "process": name}, v) for labels, v in values)
        return merged

    @staticmethod
    async def _fetch(session: aiohttp.ClientSession, url: str) -> str | None:
        try:
            async with session.get(url) as response:
                if response.status != 200:
                    return None
                return await response.text()
        except (aiohttp.ClientError, TimeoutError, ValueError):
            return None

    async def poll(self) -> FarmStatus:
        samples = await self.scrape()
        state = await self._redis_state()
        now = time.monotonic()
        counters = {
            "episodes": total(samples, "farm_worker_episodes_total"),
            "tokens": total(samples, "farm_worker_tokens_generated_total"),
            "stale_sum": total(samples, "farm_learner_staleness_steps_sum"),
            "stale_count": total(samples, "farm_learner_staleness_steps_count"),
            "groups": total(samples, "farm_learner_groups_total"),
            "zero_var": total(samples, "farm_learner_zero_variance_groups_total"),
            "zero_var_reward": total(samples, "farm_learner_zero_variance_reward_total"),
        }
        current = {k: v for k, v in counters.items() if v is not None}
        dt, deltas = self._deltas(now, current)
        rates = {k: v / dt for k, v in deltas.items()}
        step = total(samples, "farm_learner_steps_total")
        reward = total(samples, "farm_learner_reward_mean")
        elapsed = now - self.started
        if step is not None and reward is not None and step > 0:
            if not self.reward_history or self.reward_history[-1][0] != int(step):
                self.reward_history.append((int(step), reward, elapsed))
        stale_n = deltas.get("stale_count")
        staleness = deltas["stale_sum"] / stale_n if stale_n and "stale_sum" in deltas else None
        fields = _from_redis(state, self.keys)
        learner_version = _int(total(samples, "farm_learner_policy_version"))
        if learner_version is not None:
            fields["policy_version"] = learner_version
        return FarmStatus(
            elapsed_s=elapsed,
            new_eval=self._new_eval(state),
            **_zero_variance(deltas),
            learner_step=None if step is None else int(step),
            reward=reward,
            episodes_per_s=rates.get("episodes"),
            tokens_per_s=rates.get("tokens"),
            staleness_mean=staleness,
            served_versions=_served(samples),
            sandbox=_sandbox(samples),
            **fields,
        )

    def _new_eval(self, state: RunState | None) -> tuple[str, ...]:
        """The lines of the run's newest evaluation, the first time a poll sees it."""
        summary = state.last_eval if state is not None else None
        if not summary or summary == self._eval_seen:
            return ()
        self._eval_seen = summary
        return tuple(eval_lines(summary))

    def _deltas(self, now: float, current: dict[str, float]) -> tuple[float, dict[str, float]]:
        """The period since the last poll and each counter's increase over it (ratios of
        counts, not of rates, so 30 of 40 groups reads exactly 0.75)."""
        previous, self._previous = self._previous, (now, current)
        if previous is None or now <= previous[0]:
            return 1.0, {}
        return now - previous[0], {
            k: max(0.0, v - previous[1][k]) for k, v in current.items() if k in previous[1]
        }

    async def _redis_state(self) -> RunState | None:
        if self.redis is None:
            return None
        try:
            return await asyncio.wait_for(run_state(self.redis, self.keys), 3.0)
        except (BrokerError, TimeoutError):
            return None


def _zero_variance(deltas: dict[str, float]) -> dict[str, float]:
    """The share of the period's groups with zero variance, and their mean common reward."""
    groups, zero = deltas.get("groups"), deltas.get("zero_var")
    if not groups or zero is None:
        return {}
    out = {"zero_variance_share": zero / groups}
    if zero and "zero_var_reward" in deltas:
        out["zero_variance_reward"] = deltas["zero_var_reward"] / zero
    return out


def _int(value: float | None) -> int | None:
    return None if value is None else int(value)


def _served(samples: Samples) -> tuple[int, ...]:
    # The CPU policy server exports its version; vLLM does not, so the versions the
    # learner verified on each server (/weight_info after a push) stand in for them.
    values = samples.get("farm_inference_weight_version") or samples.get(
        "farm_weight_sync_served_version", []
    )
    return tuple(sorted({int(v) for _, v in values}))


def _sandbox(samples: Samples) -> dict[str, int]:
    states: dict[str, int] = defaultdict(int)
    for labels, value in samples.get("farm_sandbox_containers", []):
        states[labels.get("state", "?")] += int(value)
    return dict(states)


def _sum(values: list[int | None]) -> int | None:
    """A total, or unknown when any part is (Redis reports no lag after some trims)."""
    return None if any(v is None for v in values) else sum(v for v in values if v is not None)


def _from_redis(state: RunState | None, keys: RunKeys) -> dict[str, object]:
    if state is None:
        return {}
    out: dict[str, object] = {
        "dead_letters": state.dead_letters,
        "latest_dead_letter": state.latest_dead_letter,
        "admission": (state.admission_in_flight, state.admission_limit),
    }
    tasks_lag: list[int | None] = []
    tasks_pending: list[int] = []
    trajectories_lag: list[int | None] = []
    for stream in state.streams:  # every partition's streams: the figures are summed
        for group in stream.groups:
            if stream.name in keys.all_tasks and group.name == WORKERS_GROUP:
                tasks_lag.append(group.lag)
                tasks_pending.append(group.pending)
            elif stream.name in keys.all_trajectories and group.name == LEARNER_GROUP:
                trajectories_lag.append(group.lag)
    if tasks_pending:
        out["tasks_lag"], out["tasks_pending"] = _sum(tasks_lag), sum(tasks_pending)
    if trajectories_lag:
        out["trajectories_lag"] = _sum(trajectories_lag)
    if state.policy is not None:
        out["policy_version"] = state.policy.version
    return out
