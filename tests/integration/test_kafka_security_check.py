"""check_access against the real broker's PLAINTEXT listener: plaintext passes, and a client set
up for TLS or SASL gets one line naming the setting instead of aiokafka's retries."""

import pytest

from sluice.connectors.kafka_security import KafkaRefused, KafkaSecurity, check_access


async def test_plaintext_client_passes(bootstrap_servers):
    await check_access(bootstrap_servers, KafkaSecurity())


@pytest.mark.parametrize(
    "security",
    [
        KafkaSecurity(protocol="SSL"),
        KafkaSecurity(protocol="SASL_PLAINTEXT", username="someone", password="x"),
    ],
    ids=["tls", "sasl"],
)
async def test_client_expecting_another_protocol_is_told_which_setting(bootstrap_servers, security):
    with pytest.raises(KafkaRefused, match="KAFKA_SECURITY_PROTOCOL"):
        await check_access(bootstrap_servers, security, timeout_s=10)


async def test_nothing_listening_is_left_to_the_callers_retries():
    await check_access("127.0.0.1:9", KafkaSecurity(), timeout_s=2)
