"""Shared fixtures: where the integration tests find a real Kafka broker and a real Redis.

In order: `KAFKA_BOOTSTRAP_SERVERS` and `REDIS_URL` when set; else containers through
testcontainers when a Docker engine answers; else a stack already answering at the local stack's
default addresses (a developer's `sluice stack up`); else the local stack, which this test session
starts and stops again. Under CI (`CI=true`) a missing
broker or Redis fails the run instead of skipping it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from dataclasses import dataclass

# Triton decides at decoration time whether a kernel is compiled or interpreted, so the switch must
# be set before any kernel module is imported. Without a GPU the kernels run in Triton's CPU
# interpreter; a developer on a GPU machine gets the compiled kernels unless they set it themselves.
import torch  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

# (the Kafka and Redis helpers are imported where the integration fixtures use them: the engine's
# tests then run where only the engine's own packages are installed, as on a GPU machine)

log = logging.getLogger(__name__)

IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")


@dataclass(frozen=True)
class Endpoints:
    bootstrap_servers: str
    redis_url: str
    source: str  # where they came from


def _unavailable(reason: str):
    if IN_CI:
        pytest.fail(f"integration services unavailable under CI: {reason}", pytrace=False)
    pytest.skip(f"integration services unavailable: {reason}")


def _docker_engine_answers() -> bool:
    try:
        import docker

        client = docker.from_env(timeout=3)
        client.ping()
        return True
    except Exception:
        return False


def _default_stack_answers() -> bool:
    from sluice.connectors.kafka_broker import metadata_ok
    from sluice.connectors.redis_server import redis_ping
    from sluice.connectors.settings import StackSettings

    defaults = StackSettings()
    return asyncio.run(metadata_ok(defaults.bootstrap_servers, timeout=3)) and asyncio.run(
        redis_ping(defaults.redis_url, timeout=2)
    )


@contextlib.contextmanager
def _containers():
    from testcontainers.kafka import KafkaContainer
    from testcontainers.redis import RedisContainer

    with KafkaContainer().with_kraft() as kafka, RedisContainer() as redis:
        host = redis.get_container_host_ip()
        port = redis.get_exposed_port(6379)
        yield Endpoints(kafka.get_bootstrap_server(), f"redis://{host}:{port}/0", "testcontainers")


@contextlib.contextmanager
def _local_stack():
    from sluice.connectors.stack import LocalStack, StackError

    stack = LocalStack()
    try:
        started = stack.up()
    except StackError as exc:
        _unavailable(f"the local stack did not start: {exc}")
    try:
        yield Endpoints(stack.settings.bootstrap_servers, stack.settings.redis_url, "local stack")
    finally:
        # Stop only what this test session started; a developer's running stack stays up.
        if started["kafka"]:
            stack.kafka.stop()
        if started["redis"]:
            stack.redis.stop()


@pytest.fixture(scope="session")
def endpoints():
    from sluice.connectors.kafka_broker import metadata_ok
    from sluice.connectors.redis_server import redis_ping
    from sluice.connectors.settings import ENV_KAFKA_BOOTSTRAP, ENV_REDIS_URL, StackSettings

    env_kafka = os.environ.get(ENV_KAFKA_BOOTSTRAP)
    env_redis = os.environ.get(ENV_REDIS_URL)
    if env_kafka and env_redis:
        source = contextlib.nullcontext(Endpoints(env_kafka, env_redis, "environment"))
    elif _docker_engine_answers():
        source = _containers()
    elif _default_stack_answers():
        defaults = StackSettings()
        source = contextlib.nullcontext(
            Endpoints(defaults.bootstrap_servers, defaults.redis_url, "running local stack")
        )
    else:
        source = _local_stack()
    with source as found:
        if not asyncio.run(metadata_ok(found.bootstrap_servers, timeout=30)):
            _unavailable(f"Kafka at {found.bootstrap_servers} ({found.source}) does not answer")
        if not asyncio.run(redis_ping(found.redis_url, timeout=5)):
            _unavailable(f"Redis at {found.redis_url} ({found.source}) does not answer")
        log.info(
            "integration tests use Kafka %s and Redis %s from the %s",
            found.bootstrap_servers,
            found.redis_url,
            found.source,
        )
        yield found


@pytest.fixture
def bootstrap_servers(endpoints: Endpoints) -> str:
    return endpoints.bootstrap_servers


@pytest.fixture
def redis_url(endpoints: Endpoints) -> str:
    return endpoints.redis_url
