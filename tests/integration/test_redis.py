import asyncio
import uuid

import pytest
import redis.asyncio as aioredis

pytestmark = pytest.mark.integration


async def test_key_with_ttl_is_written_read_and_expires(redis_url):
    client = aioredis.Redis.from_url(redis_url)
    key = f"test:{uuid.uuid4().hex}"
    try:
        await client.set(key, b"turn-1", px=1_500)
        assert await client.get(key) == b"turn-1"
        ttl_ms = await client.pttl(key)
        assert 0 < ttl_ms <= 1_500
        await asyncio.sleep(1.7)
        assert await client.get(key) is None
    finally:
        await client.delete(key)
        await client.aclose()
