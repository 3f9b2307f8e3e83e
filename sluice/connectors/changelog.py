"""A key-value table backed by a compacted Kafka topic, as Kafka Streams backs a state store with
its changelog: every change is a record (key, value), a deletion a tombstone (key, null), and a
process that starts, or takes over work, reads the topic to the end to know the table.

    table = Changelog(bootstrap, "sluice.progress", producer)
    await table.start()                    # reads the whole topic: the table as it was left
    await table.put({"r1": b"...", "r2": b"..."})   # returns once the broker has them all
    table.get("r1"); await table.delete("r1")
    await table.catch_up()                 # read what other processes wrote since

Reads are local (a dict); `put` and `delete` update it at once and return once the records are
written. A record read back from the topic never overwrites a newer write of this process: each
key remembers the offset of the last write it saw, and older records are skipped.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping

from aiokafka import AIOKafkaConsumer, TopicPartition

from sluice.connectors.kafka_producer import EventProducer
from sluice.connectors.kafka_security import kafka_client_options
from sluice.connectors.topics import partitions_of
from sluice.connectors.transactions import PartitionTransactions

log = logging.getLogger(__name__)

# Compaction keeps the latest record of each key; the deletion backstop bounds what a key whose
# tombstone was never written (a crash at the wrong moment) can cost.
TOPIC_CONFIG = {
    "cleanup.policy": "compact,delete",
    "retention.ms": str(7 * 24 * 3600 * 1000),
    "min.cleanable.dirty.ratio": "0.1",
    "segment.ms": str(3600 * 1000),
}


class Changelog:
    def __init__(
        self, bootstrap_servers: str, topic: str, producer: EventProducer | PartitionTransactions
    ):
        self.bootstrap_servers = bootstrap_servers
        self.topic = topic
        self.producer = producer
        self._table: dict[str, bytes] = {}
        self._seen: dict[str, tuple[int, int]] = {}  # key -> (partition, offset) of its last record
        self._consumer: AIOKafkaConsumer | None = None
        self._partitions: list[TopicPartition] = []
        self._lock = asyncio.Lock()  # one catch-up at a time
        self.restored = 0  # records read back from the topic

    async def start(self) -> None:
        """Read the topic from the beginning to its end."""
        self._consumer = AIOKafkaConsumer(
            bootstrap_servers=self.bootstrap_servers,
            enable_auto_commit=False,
            isolation_level="read_committed",  # an aborted transaction's records never count
            **kafka_client_options(),
        )
        await self._consumer.start()
        partitions = await partitions_of(self.bootstrap_servers, self.topic)
        self._partitions = [TopicPartition(self.topic, p) for p in sorted(partitions)]
        self._consumer.assign(self._partitions)
        await self._consumer.seek_to_beginning(*self._partitions)
        await self.catch_up()
        log.info(
            "changelog %s: %d live keys after reading %d records",
            self.topic,
            len(self._table),
            self.restored,
        )

    async def stop(self) -> None:
        if self._consumer is not None:
            consumer, self._consumer = self._consumer, None
            await consumer.stop()

    @property
    def transactional(self) -> bool:
        """Whether its writes go into transactions (exactly-once)."""
        return self.producer.transactional

    def get(self, key: str) -> bytes | None:
        return self._table.get(key)

    def __len__(self) -> int:
        return len(self._table)

    def keys(self) -> list[str]:
        return list(self._table)

    async def put(self, records: Mapping[str, bytes], origin: TopicPartition | None = None) -> None:
        """Write every record, then wait until the broker has them all. `origin`: the input
        partition they follow from (its transaction, with a transactional producer)."""
        await self._write({key: value for key, value in records.items()}, origin)

    async def delete(self, *keys: str, origin: TopicPartition | None = None) -> None:
        """Tombstone the keys (compaction removes them), waiting until written."""
        await self._write({key: None for key in keys}, origin)

    async def _write(
        self, records: Mapping[str, bytes | None], origin: TopicPartition | None
    ) -> None:
        for key, value in records.items():
            if value is None:
                self._table.pop(key, None)
            else:
                self._table[key] = value
        futures = {
            key: await self.producer.send(self.topic, key=key, value=value, origin=origin)
            for key, value in records.items()
        }
        for key, future in futures.items():
            meta = await future
            self._seen[key] = max(self._seen.get(key, (-1, -1)), (meta.partition, meta.offset))

    def stage(self, records: Mapping[str, bytes | None]) -> list[tuple[str, str, bytes | None]]:
        """Take the records into the table now and return them as (topic, key, value) for the
        caller to write, in one piece with what they belong to (a transaction's events)."""
        for key, value in records.items():
            if value is None:
                self._table.pop(key, None)
            else:
                self._table[key] = value
        return [(self.topic, key, value) for key, value in records.items()]

    async def catch_up(self) -> None:
        """Read every record written until now (by any process) into the table."""
        if self._consumer is None:
            raise RuntimeError("Changelog.start() was not called")
        async with self._lock:
            ends = await self._consumer.end_offsets(self._partitions)
            while [tp for tp, end in ends.items() if await self._position(tp) < end]:
                batch = await self._consumer.getmany(timeout_ms=200)
                for records in batch.values():
                    for record in records:
                        self._apply(record)

    async def _position(self, tp: TopicPartition) -> int:
        assert self._consumer is not None
        return await self._consumer.position(tp)

    def _apply(self, record) -> None:
        self.restored += 1
        key = record.key.decode() if record.key is not None else None
        if key is None:
            return
        where = (record.partition, record.offset)
        if where < self._seen.get(key, (-1, -1)):
            return  # older than a write of ours this table already holds
        self._seen[key] = where
        if record.value is None:
            self._table.pop(key, None)
        else:
            self._table[key] = record.value
