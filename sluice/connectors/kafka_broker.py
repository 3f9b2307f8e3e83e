"""The real Apache Kafka broker, single node in KRaft mode, run from jars resolved with Maven.

No Docker needed: `mvn dependency:copy-dependencies` fetches `org.apache.kafka:kafka_2.13` and a
Log4j2 backend (the broker's own artifact leaves logging out) into a cache directory shared by
later runs; storage is formatted with `kafka.tools.StorageTool`; `kafka.Kafka` runs broker and
controller in one process on loopback.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import os
import re
import shutil
import subprocess
import time
import uuid
from pathlib import Path

from sluice.connectors.kafka_sasl_ssl import SaslSslListener
from sluice.connectors.kafka_security import KafkaSecurity
from sluice.connectors.processes import (
    StackError,
    owned_pid,
    port_answers,
    port_is_free,
    stop_pid,
    tail,
)
from sluice.connectors.settings import LOOPBACK, StackSettings

log = logging.getLogger(__name__)

LOG4J_VERSION = "2.25.3"
SLF4J_VERSION = "2.0.17"
MIN_JAVA = 17

_POM = """<project xmlns="http://maven.apache.org/POM/4.0.0">
  <modelVersion>4.0.0</modelVersion>
  <groupId>local.sluice</groupId>
  <artifactId>kafka-broker-jars</artifactId>
  <version>1</version>
  <packaging>pom</packaging>
  <dependencies>
    <dependency><groupId>org.apache.kafka</groupId><artifactId>kafka_2.13</artifactId><version>{kafka}</version></dependency>
    <dependency><groupId>org.slf4j</groupId><artifactId>slf4j-api</artifactId><version>{slf4j}</version></dependency>
    <dependency><groupId>org.apache.logging.log4j</groupId><artifactId>log4j-slf4j2-impl</artifactId><version>{log4j}</version></dependency>
    <dependency><groupId>org.apache.logging.log4j</groupId><artifactId>log4j-core</artifactId><version>{log4j}</version></dependency>
  </dependencies>
</project>
"""

_LOG4J2 = """status = warn
appender.file.type = File
appender.file.name = FILE
appender.file.fileName = {log_file}
appender.file.layout.type = PatternLayout
appender.file.layout.pattern = [%d] %p %m (%c)%n
rootLogger.level = INFO
rootLogger.appenderRef.file.ref = FILE
logger.kafka.name = org.apache.kafka
logger.kafka.level = WARN
logger.state.name = state.change.logger
logger.state.level = WARN
"""


def server_properties(
    settings: StackSettings, log_dir: Path, sasl_ssl: SaslSslListener | None = None
) -> str:
    """A single-node KRaft configuration: broker and controller in one process on loopback; the
    clients' listener is SASL_SSL when `sasl_ssl` is given (the controller's stays plaintext on
    loopback)."""
    broker = f"{LOOPBACK}:{settings.kafka_port}"
    controller = f"{LOOPBACK}:{settings.kafka_controller_port}"
    lines = {
        "process.roles": "broker,controller",
        "node.id": "1",
        "controller.quorum.voters": f"1@{controller}",
        "listeners": f"PLAINTEXT://{broker},CONTROLLER://{controller}",
        "advertised.listeners": f"PLAINTEXT://{broker}",
        "controller.listener.names": "CONTROLLER",
        "inter.broker.listener.name": "PLAINTEXT",
        "listener.security.protocol.map": "PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT",
        "log.dirs": str(log_dir),
        "num.partitions": "1",
        # One node: internal topics cannot have more replicas than brokers.
        "offsets.topic.replication.factor": "1",
        "offsets.topic.num.partitions": "8",
        "transaction.state.log.replication.factor": "1",
        "transaction.state.log.min.isr": "1",
        "transaction.state.log.num.partitions": "8",
        "share.coordinator.state.topic.replication.factor": "1",
        "share.coordinator.state.topic.min.isr": "1",
        "min.insync.replicas": "1",
        "default.replication.factor": "1",
        # Tests and the demo start consumers right away; don't wait 3 s for more members.
        "group.initial.rebalance.delay.ms": "0",
        # Topics are created on purpose, with their partition counts.
        "auto.create.topics.enable": "false",
        "log.retention.hours": "24",
        "log.segment.bytes": str(64 * 1024 * 1024),
    }
    if sasl_ssl is not None:
        secure = sasl_ssl.broker_properties(broker)
        protocols = f"{secure.pop('listener.security.protocol.map')},CONTROLLER:PLAINTEXT"
        lines.update(secure)
        lines["listeners"] += f",CONTROLLER://{controller}"
        lines["listener.security.protocol.map"] = protocols
    return "".join(f"{k}={v}\n" for k, v in lines.items())


def java_executable() -> str:
    java_home = os.environ.get("JAVA_HOME")
    if java_home and (Path(java_home) / "bin" / "java").exists():
        return str(Path(java_home) / "bin" / "java")
    java = shutil.which("java")
    if not java:
        raise StackError(
            "Java was not found: the Kafka broker needs Java "
            f"{MIN_JAVA} or newer. Install a JDK (e.g. `apt-get install openjdk-17-jre-headless`) "
            "or set JAVA_HOME."
        )
    return java


def java_major_version(java: str) -> int:
    out = subprocess.run([java, "-version"], capture_output=True, text=True, timeout=60)
    text = out.stderr + out.stdout
    match = re.search(r'version "(\d+)(?:\.(\d+))?', text)
    if not match:
        raise StackError(
            f"could not read the Java version from `{java} -version`: {text.strip()!r}"
        )
    major = int(match.group(1))
    # Java 8 and older report "1.8.0_x".
    return int(match.group(2) or 0) if major == 1 else major


class LocalKafka:
    """One Kafka broker process of ours, with its files under `settings.home / 'kafka'`."""

    def __init__(self, settings: StackSettings):
        self.settings = settings
        self.dir = settings.home / "kafka"
        self.data_dir = self.dir / "data"
        self.config_file = self.dir / "server.properties"
        self.log4j_file = self.dir / "log4j2.properties"
        self.log_file = self.dir / "broker.log"
        self.stdout_file = self.dir / "broker.out"
        self.pid_file = self.dir / "kafka.pid"
        self.sasl_ssl_dir = self.dir / "sasl_ssl"
        self.client_env_file = self.dir / "client.env"  # written while the broker is SASL_SSL
        # Written when the storage was formatted with the SASL_SSL listener's SCRAM users.
        self.scram_marker = self.data_dir / ".sluice-scram-users"
        self.jar_dir = settings.cache_dir / f"kafka-{settings.kafka_version}" / "libs"

    # -- status ------------------------------------------------------------------------------

    def pid(self) -> int | None:
        return owned_pid(self.pid_file, str(self.dir))

    def answers(self, timeout: float = 5.0) -> bool:
        """True when a metadata request to the broker succeeds."""
        return asyncio.run(metadata_ok(self.settings.bootstrap_servers, timeout, self.security()))

    def sasl_ssl(self) -> SaslSslListener | None:
        """The SASL_SSL listener of the broker as last started (or starting), if it has one."""
        if self.settings.kafka_sasl_ssl or self.client_env_file.exists():
            return SaslSslListener.load_or_create(self.sasl_ssl_dir)
        return None

    def security(self) -> KafkaSecurity:
        """How this stack's own checks log in to its broker."""
        listener = self.sasl_ssl()
        return KafkaSecurity() if listener is None else listener.client_security()

    # -- jars --------------------------------------------------------------------------------

    def ensure_jars(self) -> Path:
        """Resolve the broker's jars from Maven Central once; later runs reuse the cache."""
        marker = self.jar_dir / ".complete"
        if marker.exists():
            return self.jar_dir
        mvn = shutil.which("mvn")
        if not mvn:
            raise StackError(
                "Maven (`mvn`) was not found: it resolves the Kafka broker's jars from Maven "
                "Central. Install it (e.g. `apt-get install maven`)."
            )
        work = self.jar_dir.parent
        work.mkdir(parents=True, exist_ok=True)
        pom = work / "pom.xml"
        pom.write_text(
            _POM.format(kafka=self.settings.kafka_version, log4j=LOG4J_VERSION, slf4j=SLF4J_VERSION)
        )
        tmp = work / "libs.partial"
        shutil.rmtree(tmp, ignore_errors=True)
        print(
            f"resolving Kafka {self.settings.kafka_version} jars from Maven Central into {work} "
            "(once; later runs reuse them)...",
            flush=True,
        )
        proc = subprocess.run(
            [
                mvn,
                "-B",
                "-q",
                "-f",
                str(pom),
                "dependency:copy-dependencies",
                f"-DoutputDirectory={tmp}",
                "-DincludeScope=runtime",
            ],
            capture_output=True,
            text=True,
        )
        if proc.returncode != 0:
            last = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-15:])
            raise StackError(
                f"could not resolve org.apache.kafka:kafka_2.13:{self.settings.kafka_version} "
                f"with Maven (is Maven Central reachable?). mvn said:\n{last}"
            )
        shutil.rmtree(self.jar_dir, ignore_errors=True)
        tmp.rename(self.jar_dir)
        marker.touch()
        return self.jar_dir

    def _java(self, main: str, *args: str, **kwargs) -> subprocess.CompletedProcess:
        cmd = [
            java_executable(),
            "-cp",
            str(self.jar_dir / "*"),
            f"-Dlog4j2.configurationFile={self.log4j_file}",
            main,
            *args,
        ]
        return subprocess.run(cmd, capture_output=True, text=True, **kwargs)

    # -- lifecycle ---------------------------------------------------------------------------

    def _check_ports(self) -> None:
        for name, port in (
            ("broker", self.settings.kafka_port),
            ("controller", self.settings.kafka_controller_port),
        ):
            if not port_is_free(LOOPBACK, port):
                raise StackError(
                    f"Kafka {name} port {LOOPBACK}:{port} is in use by another process. Stop it, "
                    f"or choose another port (--kafka-port / SLUICE_KAFKA_PORT, "
                    f"--kafka-controller-port / SLUICE_KAFKA_CONTROLLER_PORT)."
                )

    def _format_storage(self, sasl_ssl: SaslSslListener | None = None) -> None:
        if (self.data_dir / "meta.properties").exists():
            if sasl_ssl is not None and not self.scram_marker.exists():
                raise StackError(
                    f"the Kafka data in {self.data_dir} was made without SASL users, which KRaft "
                    "adds only when it formats storage: use another --home for the SASL_SSL "
                    "stack, or remove that directory (its topics are lost)"
                )
            return
        cluster_id = base64.urlsafe_b64encode(uuid.uuid4().bytes).rstrip(b"=").decode()
        # `=` form: a base64 id may start with "-", which would otherwise read as an option
        proc = self._java(
            "kafka.tools.StorageTool",
            "format",
            f"--cluster-id={cluster_id}",
            "-c",
            str(self.config_file),
            *(sasl_ssl.format_arguments() if sasl_ssl else ()),
            timeout=180,
        )
        if proc.returncode != 0:
            raise StackError(
                "formatting Kafka storage failed (kafka.tools.StorageTool):\n"
                + (proc.stdout + proc.stderr).strip()[-2000:]
            )
        if sasl_ssl is not None:
            self.scram_marker.touch()

    def start(self, timeout: float = 120.0) -> bool:
        """Start the broker unless ours is already running. Returns True if it started one."""
        if self.pid() is not None:
            if self.answers(timeout=30):
                return False
            raise StackError(
                f"our Kafka broker (pid {self.pid()}) runs but does not answer on "
                f"{self.settings.bootstrap_servers}. Last lines of {self.log_file}:\n"
                + tail(self.log_file)
            )
        java = java_executable()
        if java_major_version(java) < MIN_JAVA:
            raise StackError(
                f"Kafka {self.settings.kafka_version} needs Java {MIN_JAVA}+; {java} is older."
            )
        self._check_ports()
        self.ensure_jars()
        self.dir.mkdir(parents=True, exist_ok=True)
        sasl_ssl = (
            SaslSslListener.load_or_create(self.sasl_ssl_dir)
            if self.settings.kafka_sasl_ssl
            else None
        )
        self.config_file.touch()
        self.config_file.chmod(0o600)  # it holds the SASL passwords
        self.config_file.write_text(server_properties(self.settings, self.data_dir, sasl_ssl))
        self.log4j_file.write_text(_LOG4J2.format(log_file=self.log_file))
        self._format_storage(sasl_ssl)
        if sasl_ssl is None:
            self.client_env_file.unlink(missing_ok=True)
        else:
            sasl_ssl.write_client_env(self.client_env_file)
        cmd = [
            java,
            "-Xms256m",
            "-Xmx1g",
            "-XX:+UseG1GC",
            "-Djava.awt.headless=true",
            f"-Dlog4j2.configurationFile={self.log4j_file}",
            f"-Dkafka.logs.dir={self.dir}",
            "-cp",
            str(self.jar_dir / "*"),
            "kafka.Kafka",
            str(self.config_file),
        ]
        with open(self.stdout_file, "ab") as out:
            proc = subprocess.Popen(
                cmd,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        self.pid_file.write_text(str(proc.pid))
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise StackError(
                    f"the Kafka broker exited with code {proc.returncode} while starting. "
                    f"Last lines of {self.log_file}:\n{tail(self.log_file)}\n"
                    f"{tail(self.stdout_file, 10)}"
                )
            if port_answers(LOOPBACK, self.settings.kafka_port) and self.answers(timeout=5):
                log.info(
                    "Kafka %s up on %s (pid %d)",
                    self.settings.kafka_version,
                    self.settings.bootstrap_servers,
                    proc.pid,
                )
                return True
            time.sleep(0.5)
        stop_pid(proc.pid)
        raise StackError(
            f"the Kafka broker did not answer a metadata request within {timeout:.0f} s. "
            f"Last lines of {self.log_file}:\n{tail(self.log_file)}"
        )

    def stop(self) -> bool:
        pid = self.pid()
        if pid is None:
            self.pid_file.unlink(missing_ok=True)
            return False
        stop_pid(pid, timeout=60)
        self.pid_file.unlink(missing_ok=True)
        return True


async def metadata_ok(
    bootstrap_servers: str, timeout: float, security: KafkaSecurity | None = None
) -> bool:
    """One metadata round trip with aiokafka's client: the broker is up and serving."""
    from aiokafka.client import AIOKafkaClient

    client = AIOKafkaClient(
        bootstrap_servers=bootstrap_servers,
        request_timeout_ms=int(timeout * 1000),
        **(security or KafkaSecurity.from_env()).client_options(),
    )
    try:
        await asyncio.wait_for(client.bootstrap(), timeout)
        return True
    except Exception:
        return False
    finally:
        try:
            await client.close()
        except Exception:
            pass
