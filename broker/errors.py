"""Errors raised by the broker.

    BrokerError
    ├── DecodeError          an entry's envelope or body cannot be decoded
    ├── RedisUnavailable     Redis did not answer (connection lost, timeout, loading):
    │                        an outage to ride out; the operation did not take effect,
    │                        or took effect in full (commits are idempotent)
    ├── RedisCommandFailed   Redis answered with an error (not an outage)
    ├── RedisAuthFailed      Redis refused the credentials (not retried)
    └── BudgetError          the admission budget was misused (bad limit, over-release)

Library exceptions (redis-py, msgpack) are translated at this boundary
(`broker.connection.redis_errors`); callers catch these names, never redis-py's.
"""

from __future__ import annotations


class BrokerError(Exception):
    """Base of every error the broker raises."""


class DecodeError(BrokerError):
    """A stream entry could not be decoded; the message is the dead-letter reason."""


class RedisUnavailable(BrokerError):
    """Redis did not answer: a connection error or timeout (an outage, possibly brief)."""


class RedisCommandFailed(BrokerError):
    """Redis rejected a command with an error reply; retrying the same command would not help."""


class RedisAuthFailed(BrokerError):
    """Redis rejected the user name or password; retrying would not help."""


class BudgetError(BrokerError):
    """The admission budget was used incorrectly."""
