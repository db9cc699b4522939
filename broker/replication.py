"""Waiting for replicas: a write counts as done only once `n` replicas hold it.

Redis replication is asynchronous, so a write a master acknowledged can vanish in a
failover if the master dies before its replica got it. `WAIT n timeout` blocks until
`n` replicas have acknowledged every earlier write *of the same connection*, so it
must follow the write on that connection: here both go down one pipeline (a cluster
pipeline sends all commands for one node down one connection; the WAIT is routed to
the node that owns the written key's slot). Fewer replicas than asked for within the
timeout is `RedisUnavailable`: the caller retries, and the writes retried here
(commits, task publishes) are idempotent or harmless to repeat.
"""

from __future__ import annotations

from typing import Any

from redis.asyncio.cluster import RedisCluster

from broker.errors import RedisUnavailable


def queue_wait(pipe: Any, redis: Any, key: str, replicas: int, timeout_ms: int) -> None:
    """Queue `WAIT replicas timeout_ms` on `pipe` after the writes to `key` it holds."""
    if isinstance(redis, RedisCluster):
        node = redis.get_node_from_key(key)
        pipe.execute_command("WAIT", replicas, timeout_ms, target_nodes=node)
    else:
        pipe.execute_command("WAIT", replicas, timeout_ms)


def check_wait(reached: int, replicas: int, timeout_ms: int, what: str) -> None:
    """Raise RedisUnavailable when WAIT reported fewer replicas than asked for."""
    if int(reached) < replicas:
        raise RedisUnavailable(
            f"{what} reached {reached} of {replicas} replicas within {timeout_ms} ms"
        )
