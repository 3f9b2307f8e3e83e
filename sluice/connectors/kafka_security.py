"""How every Kafka client of sluice authenticates: TLS and SASL settings from the environment.

One set of variables configures the pipeline, the client commands and the stack's own checks,
as KAFKA_BOOTSTRAP_SERVERS already does for the address:

    KAFKA_SECURITY_PROTOCOL   PLAINTEXT (default), SSL, SASL_PLAINTEXT or SASL_SSL
    KAFKA_SASL_MECHANISM      PLAIN, SCRAM-SHA-256 or SCRAM-SHA-512 (default PLAIN with SASL)
    KAFKA_SASL_USERNAME       with KAFKA_SASL_PASSWORD: the SASL credentials
    KAFKA_SSL_CAFILE          PEM file of the CAs to trust (default: the system's)
    KAFKA_SSL_CERTFILE        with KAFKA_SSL_KEYFILE: a client certificate (mutual TLS)
    KAFKA_SSL_KEY_PASSWORD    when that key is encrypted

A broker that refuses the connection for what these say (bad credentials, an untrusted
certificate, TLS on one side only) is reported by `check_access` in one line naming the setting,
instead of aiokafka's "Unable to bootstrap" after its retries.
"""

from __future__ import annotations

import asyncio
import os
import ssl
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from aiokafka.conn import create_conn
from aiokafka.errors import (
    IllegalSaslStateError,
    KafkaError,
    SaslAuthenticationFailed,
    UnsupportedSaslMechanismError,
)
from aiokafka.protocol.metadata import MetadataRequest

ENV_SECURITY_PROTOCOL = "KAFKA_SECURITY_PROTOCOL"
ENV_SASL_MECHANISM = "KAFKA_SASL_MECHANISM"
ENV_SASL_USERNAME = "KAFKA_SASL_USERNAME"
ENV_SASL_PASSWORD = "KAFKA_SASL_PASSWORD"
ENV_SSL_CAFILE = "KAFKA_SSL_CAFILE"
ENV_SSL_CERTFILE = "KAFKA_SSL_CERTFILE"
ENV_SSL_KEYFILE = "KAFKA_SSL_KEYFILE"
ENV_SSL_KEY_PASSWORD = "KAFKA_SSL_KEY_PASSWORD"

PROTOCOLS = ("PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL")
MECHANISMS = ("PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512")


class KafkaSecurityError(ValueError):
    """Security settings that cannot work together, said in one line naming the variable."""


class KafkaRefused(RuntimeError):
    """The broker answers but refuses this client: credentials, certificates or protocol."""


@dataclass(frozen=True)
class KafkaSecurity:
    protocol: str = "PLAINTEXT"
    sasl_mechanism: str = "PLAIN"
    username: str | None = None
    password: str | None = None
    cafile: str | None = None
    certfile: str | None = None
    keyfile: str | None = None
    key_password: str | None = None

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> KafkaSecurity:
        env = os.environ if environ is None else environ

        def get(name: str) -> str | None:
            return env.get(name) or None

        protocol = (get(ENV_SECURITY_PROTOCOL) or "PLAINTEXT").upper()
        mechanism = (get(ENV_SASL_MECHANISM) or "PLAIN").upper()
        security = cls(
            protocol=protocol,
            sasl_mechanism=mechanism,
            username=get(ENV_SASL_USERNAME),
            password=get(ENV_SASL_PASSWORD),
            cafile=get(ENV_SSL_CAFILE),
            certfile=get(ENV_SSL_CERTFILE),
            keyfile=get(ENV_SSL_KEYFILE),
            key_password=get(ENV_SSL_KEY_PASSWORD),
        )
        security.validate()
        return security

    @property
    def uses_sasl(self) -> bool:
        return self.protocol.startswith("SASL_")

    @property
    def uses_tls(self) -> bool:
        return self.protocol in ("SSL", "SASL_SSL")

    def validate(self) -> None:
        if self.protocol not in PROTOCOLS:
            raise KafkaSecurityError(
                f"{ENV_SECURITY_PROTOCOL}: {self.protocol!r} is not one of {', '.join(PROTOCOLS)}"
            )
        if self.uses_sasl:
            if self.sasl_mechanism not in MECHANISMS:
                raise KafkaSecurityError(
                    f"{ENV_SASL_MECHANISM}: {self.sasl_mechanism!r} is not one of "
                    f"{', '.join(MECHANISMS)}"
                )
            if not self.username or self.password is None:
                raise KafkaSecurityError(
                    f"{ENV_SECURITY_PROTOCOL}={self.protocol} needs {ENV_SASL_USERNAME} and "
                    f"{ENV_SASL_PASSWORD}"
                )
        tls_files = {
            ENV_SSL_CAFILE: self.cafile,
            ENV_SSL_CERTFILE: self.certfile,
            ENV_SSL_KEYFILE: self.keyfile,
        }
        if not self.uses_tls:
            given = [name for name, value in tls_files.items() if value]
            if given:
                raise KafkaSecurityError(
                    f"{given[0]} is set but {ENV_SECURITY_PROTOCOL}={self.protocol} uses no TLS "
                    "(SSL or SASL_SSL does)"
                )
        for name, path in tls_files.items():
            if path and not os.path.isfile(path):
                raise KafkaSecurityError(f"{name}: no such file {path!r}")
        if self.keyfile and not self.certfile:
            raise KafkaSecurityError(f"{ENV_SSL_KEYFILE} needs {ENV_SSL_CERTFILE}")

    def ssl_context(self) -> ssl.SSLContext:
        context = ssl.create_default_context(cafile=self.cafile)
        if self.certfile:
            context.load_cert_chain(self.certfile, self.keyfile, self.key_password)
        return context

    def client_options(self) -> dict[str, Any]:
        """Keyword arguments for aiokafka's producers, consumers and admin clients."""
        options: dict[str, Any] = {"security_protocol": self.protocol}
        if self.uses_tls:
            options["ssl_context"] = self.ssl_context()
        if self.uses_sasl:
            options.update(
                sasl_mechanism=self.sasl_mechanism,
                sasl_plain_username=self.username,
                sasl_plain_password=self.password,
            )
        return options

    def describe(self) -> str:
        """For logs: what is used, never the password."""
        parts = [self.protocol]
        if self.uses_sasl:
            parts.append(f"{self.sasl_mechanism} as {self.username!r}")
        if self.uses_tls:
            parts.append(f"trusting {self.cafile or 'the system CAs'}")
            if self.certfile:
                parts.append(f"client certificate {self.certfile}")
        return ", ".join(parts)


def kafka_client_options() -> dict[str, Any]:
    """The security options of this process' environment, for any aiokafka client."""
    return KafkaSecurity.from_env().client_options()


async def check_access(
    bootstrap_servers: str, security: KafkaSecurity | None = None, timeout_s: float = 10.0
) -> None:
    """Connect once to the first bootstrap server that answers, authenticating as configured,
    and ask it for metadata (a SASL listener answers a client without SASL until then).

    Raises KafkaRefused when a broker answers but refuses us; says nothing when none answers
    (the callers' own retries and errors cover a broker that is down).
    """
    security = security or KafkaSecurity.from_env()
    options = security.client_options()  # one TLS context for every address tried
    for address in bootstrap_servers.split(","):
        host, _, port = address.strip().rpartition(":")
        where = f"Kafka at {address.strip()}"
        try:
            await asyncio.wait_for(
                _connect_and_ask(host.strip("[]"), int(port), options), timeout_s
            )
        except ssl.SSLCertVerificationError as exc:
            raise KafkaRefused(
                f"{where}: its TLS certificate is not trusted ({exc.verify_message}); set "
                f"{ENV_SSL_CAFILE} to the CA that signed it"
            ) from None
        except ssl.SSLError as exc:
            raise KafkaRefused(
                f"{where}: the TLS handshake failed ({exc.reason or exc}); is this listener "
                f"TLS ({ENV_SECURITY_PROTOCOL}={security.protocol})?"
            ) from None
        except IllegalSaslStateError:
            raise KafkaRefused(
                f"{where} does not speak SASL on this listener; is "
                f"{ENV_SECURITY_PROTOCOL}={security.protocol} the listener's protocol?"
            ) from None
        except SaslAuthenticationFailed as exc:
            raise KafkaRefused(
                f"{where} refused the SASL credentials of user {security.username!r} "
                f"({security.sasl_mechanism}): {exc}"
            ) from None
        except UnsupportedSaslMechanismError as exc:
            raise KafkaRefused(f"{where}: {exc} (set {ENV_SASL_MECHANISM})") from None
        except (TimeoutError, ConnectionRefusedError):
            continue  # nobody listens there, or not yet: the callers' retries cover that
        except (KafkaError, ConnectionError) as exc:
            raise KafkaRefused(
                f"{where} answered but dropped the connection during its first request "
                f"({type(exc).__name__}): does it need another {ENV_SECURITY_PROTOCOL} than "
                f"{security.protocol}?"
            ) from None
        except OSError:
            continue
        return


async def _connect_and_ask(host: str, port: int, options: dict[str, Any]) -> None:
    conn = await create_conn(host, port, client_id="sluice-check", **options)
    try:
        await conn.send(MetadataRequest([]))
    finally:
        conn.close()
