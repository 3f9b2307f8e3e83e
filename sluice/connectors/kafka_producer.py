"""Publishing events: an idempotent producer, so retries never duplicate or reorder a stream.

Token events of one request share a key (the request id) and so a partition; with idempotence
the broker drops a retried batch it already has and keeps batches in order, so a client reading
the partition sees `seq` 0, 1, 2, ... even across network errors. `acks="all"` makes a write count
only once the in-sync replicas have it, which is what "the final event is written" must mean
before the input offset is committed.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable, Mapping
from typing import Any

from aiokafka import AIOKafkaProducer
from aiokafka.errors import KafkaError
from aiokafka.structs import RecordMetadata

from sluice.connectors.kafka_security import kafka_client_options
from sluice.connectors.settings import kafka_bootstrap_servers

log = logging.getLogger(__name__)

Headers = Mapping[str, bytes | str] | Iterable[tuple[str, bytes | str]]

# A few milliseconds gather the token events of one engine step into one request to the broker
# without adding noticeable latency to a stream (a decode step itself takes longer).
DEFAULT_LINGER_MS = 2


class EventProducer:
    transactional = False

    """`AIOKafkaProducer` with the settings the delivery guarantees need.

    ``await producer.send(...)`` queues the record (waiting only when the send buffer is full:
    backpressure) and returns a future; awaiting that future gives the record's metadata once
    the broker has it. Await the future of a request's final event before marking the input
    record done.
    """

    def __init__(
        self,
        *,
        bootstrap_servers: str | None = None,
        client_id: str = "sluice-producer",
        linger_ms: int = DEFAULT_LINGER_MS,
        compression_type: str | None = None,
        request_timeout_ms: int = 30_000,
        **kafka_options: Any,
    ) -> None:
        self._config = dict(
            bootstrap_servers=bootstrap_servers or kafka_bootstrap_servers(),
            client_id=client_id,
            enable_idempotence=True,
            acks="all",
            linger_ms=linger_ms,
            compression_type=compression_type,
            request_timeout_ms=request_timeout_ms,
            **{**kafka_client_options(), **kafka_options},
        )
        self._producer: AIOKafkaProducer | None = None

    async def start(self) -> None:
        self._producer = AIOKafkaProducer(**self._config)
        try:
            await self._producer.start()
        except BaseException:
            producer, self._producer = self._producer, None
            await producer.stop()  # release its connections; the error says what failed
            raise
        shown = {k: v for k, v in self._config.items() if "sasl" not in k and "ssl" not in k}
        log.info("producer started: %s", shown)

    async def reachable(self, timeout_s: float = 5.0) -> bool:
        """Whether a broker answers a metadata request now."""
        if self._producer is None:
            return False
        try:
            await asyncio.wait_for(self._producer.client.fetch_all_metadata(), timeout_s)
        except (KafkaError, TimeoutError, OSError):
            return False
        return True

    async def stop(self) -> None:
        """Send what is queued, then close."""
        if self._producer is not None:
            producer, self._producer = self._producer, None
            await producer.stop()

    async def __aenter__(self) -> EventProducer:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.stop()

    async def send(
        self,
        topic: str,
        key: bytes | str | None,
        value: bytes | None,
        headers: Headers | None = None,
        partition: int | None = None,
        *,
        origin: Any = None,
    ) -> asyncio.Future[RecordMetadata]:
        """Queue one record (value None: a tombstone); the returned future resolves to its
        metadata once written. (`origin`, the input partition the record follows from, matters
        only to a transactional output.)"""
        if self._producer is None:
            raise RuntimeError("EventProducer.start() was not called")
        return await self._producer.send(
            topic,
            value=value,
            key=key.encode() if isinstance(key, str) else key,
            partition=partition,
            headers=_headers(headers),
        )

    async def send_and_wait(
        self,
        topic: str,
        key: bytes | str | None,
        value: bytes,
        headers: Headers | None = None,
        partition: int | None = None,
        *,
        origin: Any = None,
    ) -> RecordMetadata:
        """Send one record and wait until the broker has it."""
        return await (await self.send(topic, key, value, headers, partition))

    async def partitions_for(self, topic: str) -> set[int]:
        """The topic's partition ids (waiting for its metadata)."""
        if self._producer is None:
            raise RuntimeError("EventProducer.start() was not called")
        return set(await self._producer.partitions_for(topic))

    async def flush(self) -> None:
        """Wait until every queued record is sent (or failed)."""
        if self._producer is not None:
            await self._producer.flush()


def _headers(headers: Headers | None) -> list[tuple[str, bytes]] | None:
    if headers is None:
        return None
    items = headers.items() if isinstance(headers, Mapping) else headers
    return [(name, v.encode() if isinstance(v, str) else bytes(v)) for name, v in items]
