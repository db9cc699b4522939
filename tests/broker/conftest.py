"""Fixtures shared by the broker tests."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis

from broker.connection import RedisSettings, connect


@pytest.fixture
async def redis(redis_server) -> AsyncIterator[aioredis.Redis]:
    """A client of the session's single-node redis-server."""
    client = await connect(RedisSettings.from_url(redis_server.url))
    yield client
    await client.aclose()
