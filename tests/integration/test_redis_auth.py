"""Redis with a password (requirepass), as `sluice stack up --redis-password` starts it: the
right URL stores sessions; a wrong or missing password is refused at once, with an error that
says so (not taken for Redis being down), and `sluice run` exits saying why."""

from __future__ import annotations

import subprocess
import sys

import pytest

from sluice.connectors.redis_server import LocalRedis
from sluice.connectors.sessions import RedisRefused, SessionStore
from sluice.connectors.settings import StackSettings
from sluice.testing.pipeline_harness import free_port, new_prefix

pytestmark = pytest.mark.integration

PASSWORD = "s3cret/with:odd@chars"


@pytest.fixture
def guarded_redis(tmp_path):
    settings = StackSettings(home=tmp_path, redis_port=free_port(), redis_password=PASSWORD)
    server = LocalRedis(settings)
    server.start()
    try:
        yield settings
    finally:
        server.stop()


async def test_the_password_is_required_and_a_wrong_one_is_named(guarded_redis, bootstrap_servers):
    settings = guarded_redis
    assert settings.redis_url.startswith("redis://:s3cret%2Fwith%3Aodd%40chars@127.0.0.1:")
    async with SessionStore(settings.redis_url) as store:
        await store.verify_credentials()
        assert await store.record_turn(
            None, "s", "r1", [{"role": "user", "content": "x"}], [1, 2], (0, 0)
        )
        record = await store.get(None, "s")
        assert record is not None and record.token_ids == [1, 2]

    plain = f"redis://127.0.0.1:{settings.redis_port}/0"
    wrong = f"redis://:nope@127.0.0.1:{settings.redis_port}/0"
    for url in (plain, wrong):
        async with SessionStore(url) as store:
            with pytest.raises(RedisRefused) as info:
                await store.verify_credentials()
        message = str(info.value)
        assert "refused the credentials" in message and "nope" not in message  # redacted

    done = subprocess.run(
        [sys.executable, "-m", "sluice", "run", "--bootstrap-servers", bootstrap_servers]
        + ["--topic-prefix", new_prefix(), "--redis-url", wrong, "--kv-cache-mb", "64"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert "refused the credentials" in done.stderr and "nope" not in done.stderr
