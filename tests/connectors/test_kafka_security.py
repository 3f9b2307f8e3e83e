"""Kafka security settings from the environment: what aiokafka is given, and the one-line errors
for settings that cannot work together."""

import ssl
import subprocess

import pytest

from sluice.connectors.kafka_security import KafkaSecurity, KafkaSecurityError


def test_default_is_plaintext_without_tls_or_sasl():
    assert KafkaSecurity.from_env({}).client_options() == {"security_protocol": "PLAINTEXT"}


def test_sasl_ssl_gives_credentials_and_a_context_trusting_the_cafile(tmp_path):
    key, cert = tmp_path / "ca.key", tmp_path / "ca.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1"]
        + ["-subj", "/CN=test-ca", "-keyout", str(key), "-out", str(cert)],
        check=True,
        capture_output=True,
    )
    env = {
        "KAFKA_SECURITY_PROTOCOL": "sasl_ssl",
        "KAFKA_SASL_MECHANISM": "scram-sha-512",
        "KAFKA_SASL_USERNAME": "alice",
        "KAFKA_SASL_PASSWORD": "secret",
        "KAFKA_SSL_CAFILE": str(cert),
    }
    security = KafkaSecurity.from_env(env)
    options = security.client_options()
    context = options.pop("ssl_context")
    assert options == {
        "security_protocol": "SASL_SSL",
        "sasl_mechanism": "SCRAM-SHA-512",
        "sasl_plain_username": "alice",
        "sasl_plain_password": "secret",
    }
    assert isinstance(context, ssl.SSLContext)
    assert context.verify_mode == ssl.CERT_REQUIRED and context.check_hostname
    assert [c["subject"] for c in context.get_ca_certs()] == [((("commonName", "test-ca"),),)]
    assert "secret" not in security.describe() and "alice" in security.describe()


@pytest.mark.parametrize(
    "env, named",
    [
        ({"KAFKA_SECURITY_PROTOCOL": "TLS"}, "KAFKA_SECURITY_PROTOCOL"),
        (
            {"KAFKA_SECURITY_PROTOCOL": "SASL_SSL", "KAFKA_SASL_USERNAME": "a"},
            "KAFKA_SASL_PASSWORD",
        ),
        (
            {
                "KAFKA_SECURITY_PROTOCOL": "SASL_PLAINTEXT",
                "KAFKA_SASL_MECHANISM": "GSSAPI",
                "KAFKA_SASL_USERNAME": "a",
                "KAFKA_SASL_PASSWORD": "b",
            },
            "KAFKA_SASL_MECHANISM",
        ),
        ({"KAFKA_SSL_CAFILE": "/nonexistent.pem"}, "KAFKA_SSL_CAFILE"),
        (
            {"KAFKA_SECURITY_PROTOCOL": "SSL", "KAFKA_SSL_CAFILE": "/nonexistent.pem"},
            "KAFKA_SSL_CAFILE",
        ),
    ],
)
def test_settings_that_cannot_work_name_the_variable(env, named):
    with pytest.raises(KafkaSecurityError, match=named):
        KafkaSecurity.from_env(env)
