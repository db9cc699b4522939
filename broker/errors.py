"""Errors raised by the broker.

    BrokerError
    ├── DecodeError        an entry's envelope or body cannot be decoded
    ├── RedisUnavailable   Redis could not be reached within the retry budget
    ├── RedisAuthFailed    Redis refused the credentials (not retried)
    └── BudgetError        the admission budget was misused (bad limit, over-release)

Library exceptions (redis-py, msgpack) are translated at this boundary.
"""

from __future__ import annotations


class BrokerError(Exception):
    """Base of every error the broker raises."""


class DecodeError(BrokerError):
    """A stream entry could not be decoded; the message is the dead-letter reason."""


class RedisUnavailable(BrokerError):
    """Redis did not answer within the configured retry budget."""


class RedisAuthFailed(BrokerError):
    """Redis rejected the user name or password; retrying would not help."""


class BudgetError(BrokerError):
    """The admission budget was used incorrectly."""
