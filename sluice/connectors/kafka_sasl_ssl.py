"""The local broker's SASL_SSL listener (`sluice stack up --kafka-sasl-ssl`): users, TLS, settings.

Clients log in as `sluice` with PLAIN, SCRAM-SHA-256 or SCRAM-SHA-512 over TLS, trusting the
stack's own CA; the broker logs in to itself as `broker` with PLAIN. Passwords are made once per
stack home and kept, with the certificates, in files only their owner can read. PLAIN users live
in the listener's JAAS settings; SCRAM users in the cluster metadata, written when the storage is
formatted (KRaft has no ZooKeeper to add them to later).
"""

from __future__ import annotations

import json
import secrets
import shlex
from dataclasses import dataclass
from pathlib import Path

from sluice.connectors.kafka_security import (
    ENV_SASL_MECHANISM,
    ENV_SASL_PASSWORD,
    ENV_SASL_USERNAME,
    ENV_SECURITY_PROTOCOL,
    ENV_SSL_CAFILE,
    KafkaSecurity,
)
from sluice.connectors.local_certificates import LocalCertificates

CLIENT_USER = "sluice"
BROKER_USER = "broker"
SCRAM_MECHANISMS = ("SCRAM-SHA-256", "SCRAM-SHA-512")
CLIENT_MECHANISM = "SCRAM-SHA-512"  # what the printed settings use: no password on the wire
_PLAIN_MODULE = "org.apache.kafka.common.security.plain.PlainLoginModule"
_SCRAM_MODULE = "org.apache.kafka.common.security.scram.ScramLoginModule"


@dataclass(frozen=True)
class SaslSslListener:
    dir: Path
    password: str  # the client user's
    broker_password: str

    @classmethod
    def load_or_create(cls, dir: Path) -> SaslSslListener:
        """This home's users and certificates, made on first use."""
        users = dir / "users.json"
        if users.exists():
            saved = json.loads(users.read_text())
            listener = cls(dir, saved["password"], saved["broker_password"])
        else:
            listener = cls(dir, secrets.token_urlsafe(18), secrets.token_urlsafe(18))
            LocalCertificates(dir).ensure()  # makes the directory, owner-only
            users.touch(mode=0o600)
            users.write_text(
                json.dumps(
                    {"password": listener.password, "broker_password": listener.broker_password}
                )
            )
        listener.certificates.ensure()
        return listener

    @property
    def certificates(self) -> LocalCertificates:
        return LocalCertificates(self.dir)

    def broker_properties(self, address: str) -> dict[str, str]:
        """server.properties entries for a SASL_SSL listener on `address` (host:port)."""
        plain_users = (
            f'user_{BROKER_USER}="{self.broker_password}" user_{CLIENT_USER}="{self.password}"'
        )
        return {
            "listeners": f"SASL_SSL://{address}",
            "advertised.listeners": f"SASL_SSL://{address}",
            "inter.broker.listener.name": "SASL_SSL",
            "listener.security.protocol.map": "SASL_SSL:SASL_SSL",
            "sasl.enabled.mechanisms": ",".join(("PLAIN", *SCRAM_MECHANISMS)),
            "sasl.mechanism.inter.broker.protocol": "PLAIN",
            "listener.name.sasl_ssl.plain.sasl.jaas.config": (
                f'{_PLAIN_MODULE} required username="{BROKER_USER}" '
                f'password="{self.broker_password}" {plain_users};'
            ),
            **{
                f"listener.name.sasl_ssl.{m.lower()}.sasl.jaas.config": f"{_SCRAM_MODULE} required;"
                for m in SCRAM_MECHANISMS
            },
            "ssl.keystore.type": "PEM",
            "ssl.keystore.location": str(self.certificates.keystore_file),
            "ssl.truststore.type": "PEM",  # the broker's own logins trust the stack's CA
            "ssl.truststore.location": str(self.certificates.ca_file),
            "ssl.client.auth": "none",
        }

    def format_arguments(self) -> list[str]:
        """StorageTool arguments that add the client user for each SCRAM mechanism."""
        arguments = []
        for mechanism in SCRAM_MECHANISMS:
            user = f"name={CLIENT_USER},password={self.password}"
            arguments += ["--add-scram", f"{mechanism}=[{user}]"]
        return arguments

    def client_security(self, mechanism: str = CLIENT_MECHANISM) -> KafkaSecurity:
        return KafkaSecurity(
            protocol="SASL_SSL",
            sasl_mechanism=mechanism,
            username=CLIENT_USER,
            password=self.password,
            cafile=str(self.certificates.ca_file),
        )

    def client_environment(self) -> dict[str, str]:
        """The KAFKA_* variables that let every sluice command in."""
        return {
            ENV_SECURITY_PROTOCOL: "SASL_SSL",
            ENV_SASL_MECHANISM: CLIENT_MECHANISM,
            ENV_SASL_USERNAME: CLIENT_USER,
            ENV_SASL_PASSWORD: self.password,
            ENV_SSL_CAFILE: str(self.certificates.ca_file),
        }

    def write_client_env(self, path: Path) -> None:
        """A file for the shell to `source`."""
        path.touch(mode=0o600)
        lines = (f"export {k}={shlex.quote(v)}\n" for k, v in self.client_environment().items())
        path.write_text("".join(lines))
