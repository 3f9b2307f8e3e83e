"""The real broker does what the pipeline relies on: idempotent produce, ordered consumption,
manual commits that survive a consumer restart, and transactions hidden from read_committed."""

from __future__ import annotations

import asyncio
import uuid
from collections import defaultdict

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, NewTopic

pytestmark = pytest.mark.integration


async def create_topic(bootstrap: str, partitions: int) -> str:
    name = f"test.{uuid.uuid4().hex[:12]}"
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        await admin.create_topics([NewTopic(name, num_partitions=partitions, replication_factor=1)])
    finally:
        await admin.close()
    return name


async def consume_until(consumer: AIOKafkaConsumer, stop_after: int, timeout: float = 60.0):
    """Read up to stop_after records; returns them and the next offset per partition."""
    records = []
    next_offsets: dict[TopicPartition, int] = {}
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while len(records) < stop_after and loop.time() < deadline:
        batch = await consumer.getmany(timeout_ms=500, max_records=500)
        for tp, msgs in batch.items():
            for msg in msgs:
                if len(records) == stop_after:
                    break
                records.append(msg)
                next_offsets[tp] = msg.offset + 1
    return records, next_offsets


async def test_ten_thousand_idempotent_messages_in_order_and_resume_after_restart(
    bootstrap_servers,
):
    total, partitions = 10_000, 4
    topic = await create_topic(bootstrap_servers, partitions)
    producer = AIOKafkaProducer(
        bootstrap_servers=bootstrap_servers, enable_idempotence=True, acks="all", linger_ms=5
    )
    await producer.start()
    try:
        futures = [
            await producer.send(topic, key=f"k{i % 17}".encode(), value=str(i).encode())
            for i in range(total)
        ]
        await producer.flush()
        metadata = [await f for f in futures]
    finally:
        await producer.stop()
    assert len({(m.partition, m.offset) for m in metadata}) == total

    group = f"group-{uuid.uuid4().hex[:8]}"

    def new_consumer() -> AIOKafkaConsumer:
        return AIOKafkaConsumer(
            topic,
            bootstrap_servers=bootstrap_servers,
            group_id=group,
            enable_auto_commit=False,
            auto_offset_reset="earliest",
        )

    first = new_consumer()
    await first.start()
    try:
        part1, offsets = await consume_until(first, stop_after=4_000)
        await first.commit(offsets)  # only what was processed
    finally:
        await first.stop()

    second = new_consumer()
    await second.start()
    try:
        part2, _ = await consume_until(second, stop_after=total - len(part1))
        # Nothing beyond the produced messages arrives.
        extra = await second.getmany(timeout_ms=1_000)
    finally:
        await second.stop()

    assert len(part1) == 4_000
    assert not any(extra.values())
    values = [int(m.value) for m in part1 + part2]
    assert sorted(values) == list(range(total)), "every message exactly once across the restart"
    per_partition = defaultdict(list)
    for m in part1 + part2:
        per_partition[m.partition].append(m)
    for msgs in per_partition.values():
        offsets_seen = [m.offset for m in msgs]
        assert offsets_seen == sorted(offsets_seen)
        # Per key, production order is kept (a key always maps to one partition).
        by_key = defaultdict(list)
        for m in msgs:
            by_key[m.key].append(int(m.value))
        for seq in by_key.values():
            assert seq == sorted(seq)


async def read_all(
    bootstrap: str, topic: str, isolation: str, expected_at_least: int
) -> list[bytes]:
    consumer = AIOKafkaConsumer(
        topic,
        bootstrap_servers=bootstrap,
        auto_offset_reset="earliest",
        isolation_level=isolation,
        enable_auto_commit=False,
    )
    await consumer.start()
    try:
        records, _ = await consume_until(consumer, stop_after=expected_at_least, timeout=20)
        more = await consumer.getmany(timeout_ms=1_000)
        records += [m for msgs in more.values() for m in msgs]
    finally:
        await consumer.stop()
    return [m.value for m in records]


async def test_aborted_transaction_is_invisible_to_read_committed(bootstrap_servers):
    topic = await create_topic(bootstrap_servers, 1)
    producer = AIOKafkaProducer(
        bootstrap_servers=bootstrap_servers, transactional_id=f"tx-{uuid.uuid4().hex[:8]}"
    )
    await producer.start()
    try:
        async with producer.transaction():
            for i in range(5):
                await producer.send(topic, value=f"committed-a{i}".encode())
        await producer.begin_transaction()
        for i in range(5):
            await producer.send(topic, value=f"aborted{i}".encode())
        await producer.flush()
        await producer.abort_transaction()
        async with producer.transaction():
            for i in range(5):
                await producer.send(topic, value=f"committed-b{i}".encode())
    finally:
        await producer.stop()

    committed = await read_all(bootstrap_servers, topic, "read_committed", expected_at_least=10)
    assert committed == [f"committed-a{i}".encode() for i in range(5)] + [
        f"committed-b{i}".encode() for i in range(5)
    ]
    # The aborted records were really written: a read_uncommitted consumer sees them.
    everything = await read_all(bootstrap_servers, topic, "read_uncommitted", expected_at_least=15)
    assert [v for v in everything if v.startswith(b"aborted")] == [
        f"aborted{i}".encode() for i in range(5)
    ]
