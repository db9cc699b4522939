"""Which model a worker asks for: the run's current LoRA adapter by name, or the base weights.

`PolicyModel` wraps the generation client as the episodes' `Generator`. Before a generation it
reads the run's published `PolicyVersion` (`broker.policy.current_policy`, at most once per
`refresh_s`; concurrent episodes share one read). When the version names an adapter, the
request goes out with `model=<adapter>` and every token is recorded with that version: the
adapter name `<run>-vN` is loaded once and never replaced, so its tokens are exactly version N
(vLLM's own `weight_versions` label is engine-wide and cannot say which adapter). With no
adapter (full-weight runs, or no policy published yet) the request is unchanged and the
server's labels are recorded as before. A policy that cannot be read (Redis unavailable, an
entry this worker cannot decode) keeps the adapter read last, with a warning.

An adapter can be unloaded between the read and the request (the learner keeps only the last
few loaded; vLLM's unload lets running requests finish but answers 404 to new ones). On
`AdapterNotServed` the turn is not recorded: the policy is read again at once and the same
turn is generated again with the current adapter. If the current policy still names an
adapter no server knows (a restarted server has no runtime-loaded adapters until the next
push), it retries with backoff within the client's `retry_budget_s`, then raises
`InferenceUnavailable`, which the episode records as an inference error.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from typing import Any

from broker.errors import DecodeError, RedisUnavailable
from broker.keys import RunKeys
from broker.policy import current_policy
from inference.client import (
    AdapterNotServed,
    Generation,
    GenerationClient,
    InferenceUnavailable,
    SamplingParams,
    ServedAdapter,
)
from inference.completion_stream import TokenSink

log = logging.getLogger(__name__)


class PolicyModel:
    """A `Generator` that asks for the run's current adapter by `model` name."""

    def __init__(
        self,
        client: GenerationClient,
        redis: Any,
        keys: RunKeys,
        refresh_s: float = 1.0,
        backoff_s: float = 0.2,
    ) -> None:
        self.client = client
        self._redis = redis
        self._keys = keys
        self.refresh_s = refresh_s
        self.backoff_s = backoff_s
        self._adapter: ServedAdapter | None = None
        self._read_at = -float("inf")
        self._lock = asyncio.Lock()

    async def current(self, *, force: bool = False) -> ServedAdapter | None:
        """The adapter of the current policy (None: base weights); re-read when older than
        `refresh_s`, or at once with `force`."""
        asked = time.monotonic()
        if not force and asked - self._read_at < self.refresh_s:
            return self._adapter
        async with self._lock:
            if self._read_at >= asked:  # another episode read it while this one waited
                return self._adapter
            try:
                policy = await current_policy(self._redis, self._keys)
            except (RedisUnavailable, DecodeError) as exc:
                # keep generating with what was read last; the next refresh tries again
                log.warning("policy not re-read, keeping adapter %s: %s", self._adapter, exc)
                self._read_at = time.monotonic()
                return self._adapter
            self._read_at = time.monotonic()
            self._adapter = (
                ServedAdapter(policy.adapter, policy.version)
                if policy is not None and policy.adapter
                else None
            )
            return self._adapter

    async def generate(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        *,
        session_id: str | None = None,
        on_tokens: TokenSink | None = None,
    ) -> Generation:
        deadline = time.monotonic() + self.client.config.retry_budget_s
        adapter = await self.current()
        while True:
            try:
                return await self.client.generate(  # a 404 comes before any streamed token
                    prompt_ids, params, session_id=session_id, adapter=adapter, on_tokens=on_tokens
                )
            except AdapterNotServed as exc:
                gone = adapter
                adapter = await self.current(force=True)
                if adapter == gone:  # the current policy's adapter itself is not served
                    if time.monotonic() + self.backoff_s > deadline:
                        raise InferenceUnavailable(
                            f"adapter {exc.adapter} is the current policy but no server serves it"
                        ) from exc
                    await asyncio.sleep(self.backoff_s)

    def end_session(self, session_id: str) -> None:
        self.client.end_session(session_id)
