"""Read every partition of a topic from a moment in the recent past on, without a consumer group:
for state that every reader rebuilds for itself (the schedulers' routing index from the runners'
KV events), where nobody's offsets need committing."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator

from aiokafka import AIOKafkaConsumer
from aiokafka.structs import TopicPartition

from sluice.connectors.kafka_security import kafka_client_options
from sluice.connectors.topics import partitions_of

log = logging.getLogger(__name__)


class TopicTail:
    def __init__(self, bootstrap_servers: str, topic: str, *, since_s: float):
        self.bootstrap_servers = bootstrap_servers
        self.topic = topic
        self.since_s = since_s  # how far back to start reading
        self._consumer: AIOKafkaConsumer | None = None
        self._ends: dict[TopicPartition, int] = {}  # what was written before start
        self.caught_up = asyncio.Event()  # set once `batches` has read up to `_ends`

    async def start(self) -> None:
        self._consumer = AIOKafkaConsumer(
            bootstrap_servers=self.bootstrap_servers,
            enable_auto_commit=False,
            **kafka_client_options(),
        )
        await self._consumer.start()
        numbers = await partitions_of(self.bootstrap_servers, self.topic)
        partitions = [TopicPartition(self.topic, p) for p in numbers]
        self._consumer.assign(partitions)
        since_ms = int((time.time() - self.since_s) * 1000)
        found = await self._consumer.offsets_for_times({tp: since_ms for tp in partitions})
        for tp in partitions:
            at = found.get(tp)
            if at is None:  # nothing written since then
                await self._consumer.seek_to_end(tp)
            else:
                self._consumer.seek(tp, at.offset)
        self._ends = await self._consumer.end_offsets(partitions)
        log.info("reading %s from %.0f s ago", self.topic, self.since_s)

    async def batches(self) -> AsyncIterator[list[bytes]]:
        """The values written since `since_s` ago, then each new batch as it comes (`caught_up`
        is set once those written before `start` are all handed out)."""
        assert self._consumer is not None, "start() first"
        while True:
            fetched = await self._consumer.getmany(timeout_ms=500)
            values = [r.value for records in fetched.values() for r in records if r.value]
            if values:
                yield values
            if not self.caught_up.is_set():
                positions = [await self._consumer.position(tp) for tp in self._ends]
                if all(at >= end for at, end in zip(positions, self._ends.values())):
                    self.caught_up.set()

    async def stop(self) -> None:
        if self._consumer is not None:
            await self._consumer.stop()
            self._consumer = None
