"""Connection and local-stack settings, read from environment variables.

The same names are used by the CLI flags, the compose file and the test fixtures, so that one
environment configures every way of running sluice.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import quote

# Environment variable names: the compose file and its test refer to these.
ENV_KAFKA_BOOTSTRAP = "KAFKA_BOOTSTRAP_SERVERS"
ENV_REDIS_URL = "REDIS_URL"
ENV_HOME = "SLUICE_HOME"
ENV_CACHE_DIR = "SLUICE_CACHE_DIR"
ENV_KAFKA_PORT = "SLUICE_KAFKA_PORT"
ENV_KAFKA_CONTROLLER_PORT = "SLUICE_KAFKA_CONTROLLER_PORT"
ENV_KAFKA_VERSION = "SLUICE_KAFKA_VERSION"
ENV_REDIS_PORT = "SLUICE_REDIS_PORT"
ENV_REDIS_APPENDFSYNC = "SLUICE_REDIS_APPENDFSYNC"
ENV_REDIS_PASSWORD = "SLUICE_REDIS_PASSWORD"
ENV_KAFKA_SASL_SSL = "SLUICE_KAFKA_SASL_SSL"

DEFAULT_KAFKA_PORT = 9092
DEFAULT_KAFKA_CONTROLLER_PORT = 9093
DEFAULT_REDIS_PORT = 6379
# How often the local Redis syncs its append-only file: "everysec" (Redis' own default: a crash
# loses at most the last second of session updates), "always" (nothing), or "off" (no file).
DEFAULT_REDIS_APPENDFSYNC = "everysec"
REDIS_APPENDFSYNC_CHOICES = ("always", "everysec", "off")
# Newest Kafka release against which aiokafka's produce, consume, commit and transactions were
# checked by tests/integration/test_kafka_broker.py.
DEFAULT_KAFKA_VERSION = "4.4.0"
LOOPBACK = "127.0.0.1"


def _project_root() -> Path | None:
    """The source checkout sluice runs from, when it runs from one (editable install)."""
    root = Path(__file__).resolve().parents[2]
    return root if (root / "pyproject.toml").is_file() else None


def default_home() -> Path:
    """Where the local stack keeps its data: project-local (git-ignored) in a checkout."""
    if os.environ.get(ENV_HOME):
        return Path(os.environ[ENV_HOME]).expanduser()
    root = _project_root()
    if root is not None:
        return root / ".sluice"
    return Path.home() / ".local" / "share" / "sluice"


def default_cache_dir() -> Path:
    """Downloaded artifacts (Kafka jars) shared by every checkout and run on this machine."""
    if os.environ.get(ENV_CACHE_DIR):
        return Path(os.environ[ENV_CACHE_DIR]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "sluice"


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{name} must be an integer port, got {raw!r}") from None


@dataclass
class StackSettings:
    """Everything the local Kafka + Redis stack needs to know."""

    home: Path = field(default_factory=default_home)
    cache_dir: Path = field(default_factory=default_cache_dir)
    kafka_port: int = field(default_factory=lambda: _env_int(ENV_KAFKA_PORT, DEFAULT_KAFKA_PORT))
    kafka_controller_port: int = field(
        default_factory=lambda: _env_int(ENV_KAFKA_CONTROLLER_PORT, DEFAULT_KAFKA_CONTROLLER_PORT)
    )
    kafka_version: str = field(
        default_factory=lambda: os.environ.get(ENV_KAFKA_VERSION) or DEFAULT_KAFKA_VERSION
    )
    redis_port: int = field(default_factory=lambda: _env_int(ENV_REDIS_PORT, DEFAULT_REDIS_PORT))
    redis_appendfsync: str = field(
        default_factory=lambda: os.environ.get(ENV_REDIS_APPENDFSYNC) or DEFAULT_REDIS_APPENDFSYNC
    )
    # When set, the stack's Redis requires it (AUTH) and redis_url carries it.
    redis_password: str | None = field(
        default_factory=lambda: os.environ.get(ENV_REDIS_PASSWORD) or None
    )

    # When set, the stack's broker takes clients on SASL_SSL only (self-signed TLS, SCRAM users).
    kafka_sasl_ssl: bool = field(
        default_factory=lambda: (
            os.environ.get(ENV_KAFKA_SASL_SSL, "").lower() in ("1", "true", "yes")
        )
    )

    @property
    def bootstrap_servers(self) -> str:
        return f"{LOOPBACK}:{self.kafka_port}"

    @property
    def redis_url(self) -> str:
        auth = f":{quote(self.redis_password, safe='')}@" if self.redis_password else ""
        return f"redis://{auth}{LOOPBACK}:{self.redis_port}/0"


def kafka_bootstrap_servers() -> str:
    """Where clients find Kafka: the environment, else the local stack's default address."""
    return os.environ.get(ENV_KAFKA_BOOTSTRAP) or StackSettings().bootstrap_servers


def redis_url() -> str:
    """Where clients find Redis: the environment, else the local stack's default URL."""
    return os.environ.get(ENV_REDIS_URL) or StackSettings().redis_url
