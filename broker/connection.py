"""Connection settings for Redis, and a connect that waits politely for it.

`RedisSettings.from_url` accepts ``redis://``, ``rediss://`` (TLS) and
``unix://`` URLs, with ``user:password@`` for ACL users. The scheme is also the
one switch to Redis Cluster: ``redis+cluster://host:port`` (or ``rediss+cluster://``
for TLS) names any one node, and the client (redis-py's `RedisCluster`) learns the
topology from it and follows MOVED/ASK redirections. Every process builds its
client here (`RedisSettings.client`, `connect`). Blocking stream reads must wait
for less than the socket timeout (redis-py's default is 5 s), so the timeout is
explicit here and consumers derive their block time from it.

A cluster's failover shows up as connection errors, CLUSTERDOWN, TRYAGAIN,
redirections past redis-py's own retries, or slots not covered yet: all of them are
`RedisUnavailable` here, an outage the roles ride out with `broker.outage.Backoff`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Annotated

import redis.asyncio as aioredis
from pydantic import AfterValidator
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import (
    AskError,
    AuthenticationError,
    ClusterError,
    RedisClusterException,
    RedisError,
    SlotNotCoveredError,
    TryAgainError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from broker.errors import RedisAuthFailed, RedisCommandFailed, RedisUnavailable

log = logging.getLogger(__name__)

# ClusterError covers CLUSTERDOWN and MASTERDOWN and "TTL exhausted" after too many
# redirections; AskError covers MOVED: both while a failover moves slots.
TRANSIENT = (
    RedisConnectionError,
    RedisTimeoutError,
    ConnectionError,
    OSError,
    ClusterError,
    TryAgainError,
    AskError,
    SlotNotCoveredError,
)
CLUSTER_SCHEMES = ("redis+cluster://", "rediss+cluster://")
REDIS_SCHEMES = ("redis://", "rediss://", "unix://", *CLUSTER_SCHEMES)
# Client is either kind; both speak the same commands.
Client = aioredis.Redis | RedisCluster


def as_str(value: bytes | str) -> str:
    """A key, id or name from a reply: bytes from our clients (decode_responses=False)."""
    return value.decode() if isinstance(value, bytes) else value


def _transient(exc: BaseException) -> bool:
    """Whether `exc` is an outage: worth waiting out, not a bad command."""
    if isinstance(exc, TRANSIENT):
        return not isinstance(exc, AuthenticationError)
    # The cluster client raises its base exception when no node answers at (re)start.
    return type(exc) is RedisClusterException and "cannot be connected" in str(exc)


@contextlib.contextmanager
def redis_errors(what: str) -> Iterator[None]:
    """Translate redis-py's errors inside the block into the broker's, naming `what` failed."""
    try:
        yield
    except (*TRANSIENT, RedisClusterException) as exc:
        if _transient(exc):
            raise RedisUnavailable(f"{what} failed: {exc}") from exc
        raise RedisCommandFailed(f"{what} failed: {exc}") from exc
    except RedisError as exc:
        raise RedisCommandFailed(f"{what} failed: {exc}") from exc


def check_redis_url(url: str) -> str:
    """Return `url` if its scheme is one Redis clients here speak; raise ValueError."""
    if not url.startswith(REDIS_SCHEMES):
        raise ValueError(
            f"unsupported Redis URL scheme in {_redact(url)!r}: must start with "
            f"{', '.join(REDIS_SCHEMES)}"
        )
    return url


# A Redis URL field of a config model, checked for a scheme the clients speak.
RedisUrl = Annotated[str, AfterValidator(check_redis_url)]
DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"  # every role's default: a local Redis


@dataclass(frozen=True)
class RedisSettings:
    """How to reach Redis."""

    url: str = DEFAULT_REDIS_URL
    socket_timeout_s: float = 5.0  # every command; blocking reads block for less
    connect_timeout_s: float = 3.0
    retry_budget_s: float = 30.0  # total time connect() keeps retrying
    tls_ca_file: str | None = None  # CA bundle that signs the server's certificate (rediss://)

    @classmethod
    def from_url(cls, url: str, **overrides: float | str | None) -> RedisSettings:
        return cls(url=check_redis_url(url), **overrides)  # type: ignore[arg-type]

    @property
    def cluster(self) -> bool:
        """Whether the URL names a Redis Cluster (``redis+cluster://``, ``rediss+cluster://``)."""
        return self.url.startswith(CLUSTER_SCHEMES)

    def client(self) -> Client:
        """A client for the URL: `RedisCluster` for the cluster schemes, else `Redis`."""
        if self.cluster:
            return self._cluster_client()
        extra: dict[str, object] = {}
        if self.url.startswith("rediss://"):
            extra["connection_class"] = _BulkSSLConnection
            if self.tls_ca_file:
                extra["ssl_ca_certs"] = self.tls_ca_file
        elif self.url.startswith("redis://"):
            extra["connection_class"] = _BulkConnection
        return aioredis.Redis.from_url(
            self.url,
            **extra,
            socket_timeout=self.socket_timeout_s,
            socket_connect_timeout=self.connect_timeout_s,
            health_check_interval=30,
            decode_responses=False,
            socket_read_size=READ_SIZE,
        )

    def _cluster_client(self) -> RedisCluster:
        url = self.url.replace("+cluster://", "://", 1)
        extra: dict[str, object] = {}
        if self.tls_ca_file and url.startswith("rediss://"):
            extra["ssl_ca_certs"] = self.tls_ca_file
        # RedisCluster fixes its connection class, so the READ_SIZE stream limit below
        # is not applied per connection; its reads still use READ_SIZE.
        return RedisCluster.from_url(
            url,
            **extra,
            socket_timeout=self.socket_timeout_s,
            socket_connect_timeout=self.connect_timeout_s,
            health_check_interval=30,
            decode_responses=False,
            socket_read_size=READ_SIZE,
        )


# Stream entries are 0.1-2 MB. redis-py reads replies 64 KiB at a time through an
# asyncio StreamReader whose 64 KiB limit pauses the socket at 128 KiB: a 2 MB reply
# took dozens of pause/resume cycles (epoll_ctl each) and buffer shifts. A larger
# limit and read size cut the consumer's CPU per entry by 20-35 % (bench broker).
READ_SIZE = 4 << 20


class _BulkReads:
    """Mixin: open the connection's asyncio stream with a READ_SIZE limit."""

    def _connection_arguments(self) -> dict[str, object]:
        return {**super()._connection_arguments(), "limit": READ_SIZE}  # type: ignore[misc]


class _BulkConnection(_BulkReads, aioredis.Connection):
    pass


class _BulkSSLConnection(_BulkReads, aioredis.SSLConnection):
    pass


async def connect(settings: RedisSettings) -> Client:
    """Return a client once Redis answers PING; back off, log one line per attempt."""
    client = settings.client()
    loop = asyncio.get_running_loop()
    deadline = loop.time() + settings.retry_budget_s
    delay = 0.1
    while True:
        try:
            await client.ping()
            return client
        except (*TRANSIENT, RedisClusterException) as exc:
            # AuthenticationError is a ConnectionError, but never transient; the cluster
            # client wraps it (as the cause) in RedisClusterException at start-up.
            if isinstance(exc, AuthenticationError) or isinstance(
                exc.__cause__, AuthenticationError
            ):
                await client.aclose()
                raise RedisAuthFailed(
                    f"Redis at {_redact(settings.url)} refused the credentials: {exc}"
                ) from exc
            if not _transient(exc):
                await client.aclose()
                raise RedisCommandFailed(f"Redis at {_redact(settings.url)}: {exc}") from exc
            if loop.time() + delay > deadline:
                await client.aclose()
                raise RedisUnavailable(
                    f"Redis at {_redact(settings.url)} unreachable for {settings.retry_budget_s:.0f}s: {exc}"
                ) from exc
            log.warning(
                "redis unreachable at %s (%s); retrying in %.1fs", _redact(settings.url), exc, delay
            )
            await asyncio.sleep(delay)
            delay = min(delay * 2, 5.0)


def _redact(url: str) -> str:
    """Hide the password in a URL for logs."""
    if "@" not in url:
        return url
    scheme, rest = url.split("://", 1)
    creds, host = rest.rsplit("@", 1)
    user = creds.split(":", 1)[0]
    return f"{scheme}://{user}:***@{host}"
