"""A second real broker started as `sluice stack up --kafka-sasl-ssl` starts one: TLS with the
stack's own CA, users logging in with PLAIN and SCRAM. A plain aiokafka client gets through with
each mechanism; `sluice run` and `sluice produce --follow` serve a request over it, configured by
the environment and by flags; a wrong password or an untrusted certificate stops a command at
once with one line naming the setting, and the password never shows."""

from __future__ import annotations

import json
import os
import ssl
import subprocess
import sys
import uuid

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, NewTopic

from sluice.connectors.kafka_broker import LocalKafka
from sluice.connectors.kafka_sasl_ssl import CLIENT_USER, SaslSslListener
from sluice.connectors.settings import StackSettings
from sluice.testing.pipeline_harness import PipelineProcess, free_port, new_prefix

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def secure_broker(tmp_path_factory):
    home = tmp_path_factory.mktemp("sasl-ssl-stack")
    settings = StackSettings(
        home=home,
        kafka_port=free_port(),
        kafka_controller_port=free_port(),
        kafka_sasl_ssl=True,
    )
    broker = LocalKafka(settings)
    broker.start()
    try:
        listener = broker.sasl_ssl()
        assert listener is not None
        yield settings.bootstrap_servers, listener
    finally:
        broker.stop()


def _wire_options(listener: SaslSslListener, mechanism: str, password: str | None = None) -> dict:
    """aiokafka settings written from the listener's files, not with sluice's own helper."""
    return dict(
        security_protocol="SASL_SSL",
        ssl_context=ssl.create_default_context(cafile=str(listener.certificates.ca_file)),
        sasl_mechanism=mechanism,
        sasl_plain_username=CLIENT_USER,
        sasl_plain_password=listener.password if password is None else password,
    )


@pytest.mark.parametrize("mechanism", ["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"])
async def test_each_mechanism_produces_and_consumes(secure_broker, mechanism):
    bootstrap, listener = secure_broker
    options = _wire_options(listener, mechanism)
    topic = f"secure-{uuid.uuid4().hex[:8]}"
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap, **options)
    await admin.start()
    try:
        await admin.create_topics([NewTopic(topic, 1, 1)])
    finally:
        await admin.close()
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, **options)
    await producer.start()
    try:
        await producer.send_and_wait(topic, b"over TLS", key=b"k")
    finally:
        await producer.stop()
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, group_id=None, **options)
    await consumer.start()
    try:
        consumer.assign([TopicPartition(topic, 0)])
        await consumer.seek_to_beginning()
        record = await consumer.getone()
        assert (record.key, record.value) == (b"k", b"over TLS")
    finally:
        await consumer.stop()


def _sluice(*args: str, env: dict[str, str], timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "sluice", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **env},
    )


def test_the_pipeline_serves_a_request_over_sasl_ssl(secure_broker, tmp_path):
    bootstrap, listener = secure_broker
    prefix = new_prefix()
    # The pipeline from the environment (SCRAM-SHA-512, as `stack up` prints it) ...
    pipeline = PipelineProcess(bootstrap, None, prefix, tmp_path, env=listener.client_environment())
    try:
        pipeline.wait_ready()
        # ... the client from flags (PLAIN), its password alone from the environment.
        done = _sluice(
            "produce", "--bootstrap-servers", bootstrap, "--topic-prefix", prefix,
            "--security-protocol", "SASL_SSL", "--sasl-mechanism", "PLAIN",
            "--sasl-username", CLIENT_USER, "--ssl-cafile", str(listener.certificates.ca_file),
            "--max-tokens", "6", "--temperature", "0", "--follow", "--json", "--timeout", "120",
            "The capital of France is",
            env={"KAFKA_SASL_PASSWORD": listener.password},
        )  # fmt: skip
        assert done.returncode == 0, done.stderr + pipeline.tail()
        events = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
        finals = [e for e in events if e.get("type") == "final"]
        tokens = [e for e in events if e.get("type") == "token"]
        assert len(finals) == 1 and tokens, done.stdout
        assert "".join(t["text"] for t in tokens) == finals[0]["text"]
        assert "SASL_SSL, SCRAM-SHA-512 as 'sluice'" in pipeline.text()  # what it logged using
        assert listener.password not in pipeline.text()
    finally:
        assert pipeline.stop() == 0, pipeline.tail()


def test_a_wrong_password_stops_sluice_run_with_one_line(secure_broker):
    bootstrap, listener = secure_broker
    env = {**listener.client_environment(), "KAFKA_SASL_PASSWORD": "not-the-password"}
    done = _sluice(
        "run", "--bootstrap-servers", bootstrap, "--topic-prefix", new_prefix(),
        "--no-sessions", "--kv-cache-mb", "64",
        env=env,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert "refused the SASL credentials of user 'sluice' (SCRAM-SHA-512)" in done.stderr
    assert "not-the-password" not in done.stderr


def test_an_untrusted_certificate_names_the_ca_setting(secure_broker):
    bootstrap, listener = secure_broker
    env = {**listener.client_environment(), "KAFKA_SSL_CAFILE": ""}  # trust the system CAs only
    done = _sluice("tail", "--bootstrap-servers", bootstrap, "--timeout", "5", env=env)
    assert done.returncode == 2, done.stderr
    assert "its TLS certificate is not trusted" in done.stderr
    assert "set KAFKA_SSL_CAFILE" in done.stderr


def test_a_plaintext_client_is_told_the_listener_wants_another_protocol(secure_broker):
    bootstrap, _ = secure_broker
    done = _sluice(
        "tail", "--bootstrap-servers", bootstrap, "--timeout", "5",
        env={"KAFKA_SECURITY_PROTOCOL": "PLAINTEXT"},
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert "does it need another KAFKA_SECURITY_PROTOCOL than PLAINTEXT?" in done.stderr
