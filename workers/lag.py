"""Event-loop lag: how late a timer that should fire every `interval_s` actually fires.

Lag is the scheduling delay every coroutine on the loop suffers; it is exported as the
`farm_worker_event_loop_lag_seconds` histogram and kept in a bounded window of recent
samples for the benchmark's percentiles.
"""

from __future__ import annotations

import asyncio
import collections

from workers import metrics


class LagMonitor:
    """Samples event-loop lag until cancelled."""

    def __init__(self, interval_s: float = 0.05, window: int = 100_000) -> None:
        self.interval_s = interval_s
        self.samples: collections.deque[float] = collections.deque(maxlen=window)

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            expected = loop.time() + self.interval_s
            await asyncio.sleep(self.interval_s)
            lag = max(0.0, loop.time() - expected)
            self.samples.append(lag)
            metrics.EVENT_LOOP_LAG.observe(lag)

    def percentile(self, q: float) -> float:
        """The q-quantile (0..1) of the recorded lags; 0.0 when none were recorded."""
        if not self.samples:
            return 0.0
        ordered = sorted(self.samples)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]
