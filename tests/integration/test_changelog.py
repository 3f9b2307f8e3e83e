"""The changelog-backed table on the real broker: what one process wrote, another reads back at
start; tombstones delete; `catch_up` sees another writer's records; a record read back never
overwrites a newer write of this process; the topic is compacted. Checked against a plain aiokafka
consumer where it matters."""

from __future__ import annotations

import uuid

import pytest
from aiokafka import AIOKafkaConsumer
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType

from sluice.connectors.changelog import TOPIC_CONFIG, Changelog
from sluice.connectors.kafka_producer import EventProducer
from sluice.connectors.topics import ensure_topics

pytestmark = pytest.mark.integration


@pytest.fixture
async def topic(bootstrap_servers) -> str:
    name = f"t{uuid.uuid4().hex[:10]}.progress"
    await ensure_topics(bootstrap_servers, {name: 3}, config=TOPIC_CONFIG)
    return name


@pytest.fixture
async def producer(bootstrap_servers):
    async with EventProducer(bootstrap_servers=bootstrap_servers) as p:
        yield p


async def test_a_new_table_reads_what_an_earlier_one_left(bootstrap_servers, topic, producer):
    first = Changelog(bootstrap_servers, topic, producer)
    await first.start()
    assert len(first) == 0
    await first.put({"a": b"1", "b": b"2", "c": b"3"})
    await first.put({"a": b"1b"})
    await first.delete("b")
    assert (first.get("a"), first.get("b"), first.get("c")) == (b"1b", None, b"3")
    await first.stop()

    second = Changelog(bootstrap_servers, topic, producer)
    await second.start()
    try:
        assert (second.get("a"), second.get("b"), second.get("c")) == (b"1b", None, b"3")
        assert len(second) == 2 and second.restored == 5
    finally:
        await second.stop()

    # on the wire: keyed records, the deletion a tombstone (null value)
    consumer = AIOKafkaConsumer(
        topic,
        bootstrap_servers=bootstrap_servers,
        auto_offset_reset="earliest",
        enable_auto_commit=False,
    )
    await consumer.start()
    try:
        records = []
        while len(records) < 5:
            batch = await consumer.getmany(timeout_ms=2000)
            assert batch, records
            records += [r for rs in batch.values() for r in rs]
    finally:
        await consumer.stop()
    by_key: dict[bytes, list] = {}
    for r in sorted(records, key=lambda r: r.offset):
        by_key.setdefault(r.key, []).append(r.value)
    assert by_key == {b"a": [b"1", b"1b"], b"b": [b"2", None], b"c": [b"3"]}


async def test_catch_up_reads_another_writer_but_keeps_newer_own_writes(
    bootstrap_servers, topic, producer
):
    mine = Changelog(bootstrap_servers, topic, producer)
    theirs = Changelog(bootstrap_servers, topic, producer)
    await mine.start()
    await theirs.start()
    try:
        await theirs.put({"x": b"theirs", "y": b"theirs"})
        await mine.put({"y": b"mine, later"})
        assert mine.get("x") is None
        await mine.catch_up()
        assert mine.get("x") == b"theirs"
        assert mine.get("y") == b"mine, later"  # their older record of y does not win
        await theirs.catch_up()
        assert theirs.get("y") == b"mine, later"  # and the newer record wins there too
    finally:
        await mine.stop()
        await theirs.stop()


async def test_the_topic_is_compacted(bootstrap_servers, topic):
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap_servers)
    await admin.start()
    try:
        (described,) = await admin.describe_configs(
            [ConfigResource(ConfigResourceType.TOPIC, topic)]
        )
    finally:
        await admin.close()
    configs = {entry[0]: entry[1] for entry in described.resources[0][4]}
    assert set(configs["cleanup.policy"].split(",")) == {"compact", "delete"}
