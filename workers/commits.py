"""A worker's group commits, coalesced: groups that finish while a commit is in flight go
out together in the next one, as one script call (`Consumer.commit`).

Invariants:
- a task is acked only in the same script call that publishes its group, as before;
- nothing waits for company: a queued group goes out as soon as the commit before it is
  done, so a lone group costs what it did, and a burst of groups costs one round trip;
- a commit that meets an outage (`RedisUnavailable`) is retried with backoff until each
  group's deadline (`patience_s` after it was queued); a group past its deadline is left
  pending for reclaim (its `commit` returns False), the others go on retrying;
- a group whose waiting task is cancelled before its commit goes out is dropped from the
  queue and stays pending (a commit already sent completes, as `Consumer.commit` does);
- a group Redis refuses (any other `BrokerError`) fails alone: a refused batch is retried
  group by group, and only the refused ones return False.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from broker.consumer import Consumer, Delivery
from broker.errors import BrokerError, RedisUnavailable
from broker.messages import TrajectoryGroup
from broker.outage import Backoff

log = logging.getLogger(__name__)


@dataclass(frozen=True, eq=False)
class _Pending:
    """One finished group waiting for its commit."""

    delivery: Delivery  # the task entry to ack
    stream: str  # trajectories stream (partition) to publish the group to
    group: TrajectoryGroup  # the finished group
    deadline: float  # loop time after which an outage leaves the task pending
    done: asyncio.Future[bool]  # True: committed; False: left pending


class GroupCommits:
    """Queue of finished groups and the one task that commits them in batches."""

    def __init__(self, consumer: Consumer, patience_s: float, max_batch: int = 64) -> None:
        self._consumer = consumer
        self._patience_s = patience_s
        self._max_batch = max_batch
        self._queue: list[_Pending] = []
        self._queued = asyncio.Event()

    async def commit(self, delivery: Delivery, stream: str, group: TrajectoryGroup) -> bool:
        """Publish `group` to `stream` and ack its task; False when it was left pending."""
        loop = asyncio.get_running_loop()
        item = _Pending(
            delivery, stream, group, loop.time() + self._patience_s, loop.create_future()
        )
        self._queue.append(item)
        self._queued.set()
        return await item.done

    async def run(self) -> None:
        """Commit whatever is queued, batch after batch, until cancelled."""
        while True:
            await self._queued.wait()
            self._queued.clear()
            while self._queue:
                batch = self._queue[: self._max_batch]
                del self._queue[: len(batch)]
                # a group whose task was cancelled (worker stopping) is not acked
                batch = [i for i in batch if not i.done.cancelled()]
                if batch:
                    await self._send(batch)

    async def _send(self, batch: list[_Pending]) -> None:
        loop = asyncio.get_running_loop()
        backoff = Backoff(f"committing {len(batch)} groups")
        while batch:
            try:
                await self._consumer.commit(
                    [i.delivery for i in batch], publish=[(i.stream, i.group) for i in batch]
                )
            except RedisUnavailable as exc:
                late = [i for i in batch if loop.time() + backoff.delay > i.deadline]
                for item in late:
                    _settle(item, False, f"could not commit {item.group.group_id}: {exc}")
                batch = [i for i in batch if i not in late]
                if batch:
                    await backoff.wait(exc)
                continue
            except BrokerError as exc:
                if len(batch) == 1:
                    _settle(batch[0], False, f"could not commit {batch[0].group.group_id}: {exc}")
                    return
                for item in batch:  # find the refused one(s); the rest commit
                    await self._send([item])
                return
            backoff.reset()
            for item in batch:
                _settle(item, True)
            return


def _settle(item: _Pending, committed: bool, why: str = "") -> None:
    if why:
        log.warning("%s (left pending)", why)
    if not item.done.done():  # its group task may have been cancelled meanwhile
        item.done.set_result(committed)
