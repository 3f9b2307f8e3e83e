"""Exactly-once output: one transactional producer per input partition, as Kafka Streams runs one
per task.

Everything the pipeline writes because of a record of input partition P (token events, final and
error events, progress records) goes into P's open transaction, and so do P's input offsets:
every commit interval `commit` adds the offsets of P's finished records
(`send_offsets_to_transaction`) and commits, so the events, the progress and the offsets of P
become visible together, or, after a crash, not at all. A consumer reading with
`isolation_level=read_committed` then sees each event exactly once.

aiokafka has no KIP-447 (fencing by consumer-group generation), so the transactional id names the
partition: `APP-TOPIC-PARTITION`. The member that is assigned P next starts a producer with the
same id, which fences the previous owner (its open transaction is aborted, its later writes are
refused): a process that lost P, or was thought dead, cannot add to P's output any more.

    output = PartitionTransactions(bootstrap, app_id="sluice", group_id="sluice")
    await output.assign({tp})                       # on assignment: fence, begin
    await output.send(topic, key, value, origin=tp) # into tp's open transaction
    await output.commit({tp: next_offset})          # every interval: offsets + commit + begin
    await output.revoke({tp}, {tp: next_offset})    # on revocation: last commit, close
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from aiokafka import AIOKafkaProducer, TopicPartition
from aiokafka.structs import RecordMetadata

from sluice.connectors.kafka_security import kafka_client_options

log = logging.getLogger(__name__)


class NotOwned(LookupError):
    """The input partition is not (any more) assigned here: its output is its new owner's."""


class _Partition:
    """One input partition's producer and its open transaction."""

    def __init__(self, producer: AIOKafkaProducer):
        self.producer = producer
        self.lock = asyncio.Lock()  # a send never lands between a commit and the next begin
        self.dirty = False  # written to since the transaction began


class PartitionTransactions:
    transactional = True

    def __init__(
        self,
        bootstrap_servers: str,
        *,
        app_id: str,
        group_id: str,
        linger_ms: int = 2,
        **kafka_options: Any,
    ):
        self.bootstrap_servers = bootstrap_servers
        self.app_id = app_id
        self.group_id = group_id
        self._options = dict(
            linger_ms=linger_ms, acks="all", **{**kafka_client_options(), **kafka_options}
        )
        self._partitions: dict[TopicPartition, _Partition] = {}
        self.commits = 0  # transactions committed

    def transactional_id(self, tp: TopicPartition) -> str:
        return f"{self.app_id}-{tp.topic}-{tp.partition}"

    async def assign(self, tps: Iterable[TopicPartition]) -> None:
        """Start (and so fence every earlier producer of) each partition's producer, and open
        its first transaction."""
        for tp in tps:
            if tp in self._partitions:
                continue
            producer = AIOKafkaProducer(
                bootstrap_servers=self.bootstrap_servers,
                transactional_id=self.transactional_id(tp),
                enable_idempotence=True,
                client_id=f"sluice-{tp.topic}-{tp.partition}",
                **self._options,
            )
            await producer.start()
            await producer.begin_transaction()
            self._partitions[tp] = _Partition(producer)
            log.info(
                "transactional producer %s started (earlier owners fenced)",
                self.transactional_id(tp),
            )

    async def revoke(
        self, tps: Iterable[TopicPartition], offsets: Mapping[TopicPartition, int]
    ) -> None:
        """Commit each partition's last transaction (with its offsets) and close its producer."""
        tps = [tp for tp in tps if tp in self._partitions]
        await self.commit({tp: o for tp, o in offsets.items() if tp in tps}, only=tps)
        for tp in tps:
            part = self._partitions.pop(tp)
            await part.producer.stop()

    async def stop(self) -> None:
        await self.revoke(list(self._partitions), {})

    async def send(
        self,
        topic: str,
        key: bytes | str | None,
        value: bytes | None,
        headers: Any = None,
        partition: int | None = None,
        *,
        origin: TopicPartition | None = None,
    ) -> asyncio.Future[RecordMetadata]:
        """Queue a record in the open transaction of `origin` (the input partition it answers);
        the future resolves once the broker has it (visible to read_committed at the commit)."""
        part = self._partitions.get(origin) if origin is not None else None
        if part is None:
            raise NotOwned(f"no transaction for input partition {origin}: not assigned here")
        async with part.lock:
            part.dirty = True
            return await part.producer.send(
                topic,
                value=value,
                key=key.encode() if isinstance(key, str) else key,
                partition=partition,
                headers=headers,
            )

    async def send_together(
        self,
        origin: TopicPartition | None,
        records: Sequence[tuple[str, str | bytes | None, bytes | None]],
    ) -> list[asyncio.Future[RecordMetadata]]:
        """Queue (topic, key, value) records in one piece of `origin`'s open transaction: no
        commit falls between them, so they become visible together."""
        part = self._partitions.get(origin) if origin is not None else None
        if part is None:
            raise NotOwned(f"no transaction for input partition {origin}: not assigned here")
        async with part.lock:
            part.dirty = True
            return [
                await part.producer.send(
                    topic, value=value, key=key.encode() if isinstance(key, str) else key
                )
                for topic, key, value in records
            ]

    async def send_and_wait(self, topic, key, value, headers=None, partition=None, *, origin=None):
        return await (await self.send(topic, key, value, headers, partition, origin=origin))

    async def commit(
        self,
        offsets: Mapping[TopicPartition, int],
        only: Iterable[TopicPartition] | None = None,
    ) -> None:
        """For every partition (of `only`) written to or with an offset to commit: add its offset
        to its transaction, commit, and begin the next."""
        tps = list(self._partitions) if only is None else list(only)
        for tp in tps:
            part = self._partitions.get(tp)
            if part is None or not (part.dirty or tp in offsets):
                continue
            async with part.lock:
                if tp in offsets:
                    await part.producer.send_offsets_to_transaction(
                        {tp: offsets[tp]}, self.group_id
                    )
                await part.producer.commit_transaction()
                await part.producer.begin_transaction()
                part.dirty = False
                self.commits += 1

    async def flush(self) -> None:
        for part in self._partitions.values():
            await part.producer.flush()
