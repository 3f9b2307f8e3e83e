"""The local SASL_SSL broker's settings as written, before any broker reads them: the client
listener is SASL_SSL and the controller's stays plaintext on loopback; users and certificates are
made once per home, kept, and readable by their owner alone."""

from __future__ import annotations

import ssl
import stat
from pathlib import Path

from sluice.connectors.kafka_broker import server_properties
from sluice.connectors.kafka_sasl_ssl import SaslSslListener
from sluice.connectors.settings import StackSettings


def _properties(text: str) -> dict[str, str]:
    return dict(line.split("=", 1) for line in text.splitlines())


def test_clients_get_sasl_ssl_and_the_controller_stays_plaintext(tmp_path):
    listener = SaslSslListener.load_or_create(tmp_path / "sasl")
    settings = StackSettings(home=tmp_path, kafka_port=19092, kafka_controller_port=19093)
    props = _properties(server_properties(settings, Path("/data"), listener))
    assert props["listeners"] == "SASL_SSL://127.0.0.1:19092,CONTROLLER://127.0.0.1:19093"
    assert props["advertised.listeners"] == "SASL_SSL://127.0.0.1:19092"
    assert props["listener.security.protocol.map"] == "SASL_SSL:SASL_SSL,CONTROLLER:PLAINTEXT"
    assert props["inter.broker.listener.name"] == "SASL_SSL"
    jaas = props["listener.name.sasl_ssl.plain.sasl.jaas.config"]
    assert f'user_sluice="{listener.password}"' in jaas
    assert props["ssl.keystore.location"] == str(listener.certificates.keystore_file)
    plain = _properties(server_properties(settings, Path("/data")))
    assert plain["listeners"].startswith("PLAINTEXT://") and "sasl.enabled.mechanisms" not in plain


def test_users_and_certificates_are_made_once_and_kept_private(tmp_path):
    first = SaslSslListener.load_or_create(tmp_path / "sasl")
    ca = first.certificates.ca_file.read_bytes()
    again = SaslSslListener.load_or_create(tmp_path / "sasl")
    assert (again.password, again.broker_password) == (first.password, first.broker_password)
    assert again.certificates.ca_file.read_bytes() == ca
    assert first.password != first.broker_password
    for path in (tmp_path / "sasl" / "users.json", first.certificates.keystore_file):
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path


def test_the_broker_certificate_is_signed_by_the_ca_for_loopback(tmp_path):
    listener = SaslSslListener.load_or_create(tmp_path / "sasl")
    context = ssl.create_default_context(cafile=str(listener.certificates.ca_file))
    # The keystore holds the broker's key and the chain a TLS server presents.
    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server.load_cert_chain(str(listener.certificates.keystore_file))
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    s_in, s_out = ssl.MemoryBIO(), ssl.MemoryBIO()
    client = context.wrap_bio(incoming, outgoing, server_hostname="127.0.0.1")
    served = server.wrap_bio(s_in, s_out, server_side=True)
    for _ in range(10):  # shuttle the handshake between the two ends in memory
        for end in (client, served):
            try:
                end.do_handshake()
            except ssl.SSLWantReadError:
                pass
        s_in.write(outgoing.read())
        incoming.write(s_out.read())
    client.do_handshake()  # raises SSLCertVerificationError if the chain or name were wrong
    assert client.getpeercert()["subjectAltName"] == (
        ("IP Address", "127.0.0.1"),
        ("DNS", "localhost"),
    )
