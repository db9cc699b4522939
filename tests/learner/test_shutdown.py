"""The learner's shutdown after its run: each part within a deadline, a stuck one named.

The compose tests twice saw a learner sit for minutes after its last step, under load, never
logging `done`. The cause was not caught in the act; the stuck part here is a stand-in (a
task that never returns), the fault that could not be made for real.
"""

from __future__ import annotations

import asyncio
import logging

import pytest
import redis.asyncio as aioredis

from learner import service


async def test_a_stuck_part_is_cancelled_and_named_and_the_rest_still_close(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(service, "SHUTDOWN_PART_S", 0.2)
    stuck = asyncio.create_task(asyncio.Event().wait(), name="stuck keeper")
    gauges = asyncio.create_task(asyncio.sleep(3600), name="gauges")
    client = aioredis.Redis(port=1)  # never connected: closing it is immediate
    loop = asyncio.get_running_loop()
    started = loop.time()
    with caplog.at_level(logging.WARNING, logger="learner"):
        await service._shut_down(stuck, gauges, None, client)
    assert loop.time() - started < 2.0
    await asyncio.sleep(0)  # let the cancellations land
    assert stuck.cancelled() and gauges.cancelled()
    warnings = [r.getMessage() for r in caplog.records]
    assert warnings == ["the stream keeper did not stop within 0.2 s after the run; left behind"]


async def test_parts_that_stop_leave_no_warning(caplog: pytest.LogCaptureFixture) -> None:
    done = asyncio.create_task(asyncio.sleep(0), name="keeper")
    with caplog.at_level(logging.WARNING, logger="learner"):
        await service._shut_down(done, None, None, aioredis.Redis(port=1))
    assert not caplog.records
