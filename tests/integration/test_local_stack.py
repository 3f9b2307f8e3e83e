"""`sluice stack` as a user runs it: a second `up` is a no-op, `down` leaves nothing behind, and a
bad configuration gets a message that names the problem."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from sluice.connectors.processes import pid_alive

pytestmark = pytest.mark.integration


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def sluice(*args: str, env: dict[str, str] | None = None, timeout: float = 300):
    return subprocess.run(
        [sys.executable, "-m", "sluice", *args],
        capture_output=True,
        text=True,
        env=env or os.environ.copy(),
        timeout=timeout,
    )


@pytest.fixture
def stack_env(tmp_path: Path) -> dict[str, str]:
    """A second stack on its own ports and data directory, beside any stack already running."""
    env = os.environ.copy()
    env.update(
        SLUICE_HOME=str(tmp_path / "home"),
        SLUICE_KAFKA_PORT=str(free_port()),
        SLUICE_KAFKA_CONTROLLER_PORT=str(free_port()),
        SLUICE_REDIS_PORT=str(free_port()),
    )
    yield env
    sluice("stack", "down", env=env)


def test_up_twice_is_a_noop_and_down_leaves_no_process(stack_env):
    first = sluice("stack", "up", env=stack_env)
    assert first.returncode == 0, first.stderr
    assert "kafka: started" in first.stdout and "redis: started" in first.stdout
    assert f"KAFKA_BOOTSTRAP_SERVERS=127.0.0.1:{stack_env['SLUICE_KAFKA_PORT']}" in first.stdout
    assert f"REDIS_URL=redis://127.0.0.1:{stack_env['SLUICE_REDIS_PORT']}/0" in first.stdout
    home = Path(stack_env["SLUICE_HOME"])
    kafka_pid = int((home / "kafka" / "kafka.pid").read_text())
    redis_pid = int((home / "redis" / "redis.pid").read_text())

    second = sluice("stack", "up", env=stack_env)
    assert second.returncode == 0, second.stderr
    assert "kafka: already running" in second.stdout and "redis: already running" in second.stdout
    assert int((home / "kafka" / "kafka.pid").read_text()) == kafka_pid

    assert sluice("stack", "status", env=stack_env).returncode == 0

    down = sluice("stack", "down", env=stack_env)
    assert down.returncode == 0, down.stderr
    assert not pid_alive(kafka_pid) and not pid_alive(redis_pid)
    status = sluice("stack", "status", env=stack_env)
    assert status.returncode == 1
    assert "kafka: down" in status.stdout


def test_port_in_use_is_named(stack_env):
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        port = squatter.getsockname()[1]
        env = dict(stack_env, SLUICE_KAFKA_PORT=str(port))
        result = sluice("stack", "up", env=env)
    assert result.returncode != 0
    assert f"port 127.0.0.1:{port} is in use" in result.stderr
    assert "Traceback" not in result.stderr
    # The failed start left no Redis of ours running.
    assert (
        not (Path(env["SLUICE_HOME"]) / "redis" / "redis.pid").exists()
        or sluice("stack", "status", env=env).returncode == 1
    )


def test_missing_java_is_named(stack_env, tmp_path):
    # A PATH with redis-server and mvn but no java, and no JAVA_HOME.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("redis-server", "mvn"):
        found = subprocess.run(["which", tool], capture_output=True, text=True).stdout.strip()
        if found:
            (bin_dir / tool).symlink_to(found)
    env = dict(stack_env, PATH=str(bin_dir))
    env.pop("JAVA_HOME", None)
    result = sluice("stack", "up", env=env)
    assert result.returncode != 0
    assert "Java was not found" in result.stderr
    assert "Traceback" not in result.stderr


def test_unreachable_maven_repository_is_named(stack_env, tmp_path):
    # An empty jar cache and a Maven whose only repository is a closed port on loopback.
    user_home = tmp_path / "maven-home"
    (user_home / ".m2").mkdir(parents=True)
    (user_home / ".m2" / "settings.xml").write_text(
        "<settings><mirrors><mirror><id>nowhere</id><mirrorOf>*</mirrorOf>"
        f"<url>http://127.0.0.1:{free_port()}/maven2</url></mirror></mirrors></settings>"
    )
    env = dict(
        stack_env, SLUICE_CACHE_DIR=str(tmp_path / "cache"), MAVEN_OPTS=f"-Duser.home={user_home}"
    )
    result = sluice("stack", "up", env=env)
    assert result.returncode != 0
    assert "could not resolve org.apache.kafka:kafka_2.13" in result.stderr
    assert "Maven Central reachable" in result.stderr
    assert "Traceback" not in result.stderr


def test_storage_formats_with_a_cluster_id_that_starts_with_a_dash(tmp_path, monkeypatch):
    # A random base64 cluster id starts with "-" one time in 64; the storage tool must not read it
    # as an option (this once failed a whole CI run).
    import uuid

    from sluice.connectors import kafka_broker
    from sluice.connectors.settings import StackSettings

    kafka = kafka_broker.LocalKafka(StackSettings(home=tmp_path / "home"))
    kafka.ensure_jars()
    kafka.dir.mkdir(parents=True)
    kafka.config_file.write_text(kafka_broker.server_properties(kafka.settings, kafka.data_dir))
    leading_dash = uuid.UUID(bytes=bytes([0xF8]) + bytes(15))  # urlsafe base64 "-AAA..."
    monkeypatch.setattr(kafka_broker.uuid, "uuid4", lambda: leading_dash)
    kafka._format_storage()
    assert "cluster.id=-AAAAAAAAAAAAAAAAAAAAA" in (kafka.data_dir / "meta.properties").read_text()
