"""How an actor's output reaches the next actor: a mailbox in one process, a Kafka topic across
processes. Actors only see a `Sink`, so the same actor code runs both ways."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from pydantic import BaseModel

from sluice.actors.messages import Envelope
from sluice.connectors.kafka_producer import EventProducer

Sink = Callable[[Envelope], Awaitable[None]]


class KafkaSink:
    """Publishes each message to a topic; its input is done only once Kafka has it."""

    def __init__(self, producer: EventProducer, topic: str, key: Callable[[BaseModel], str]):
        self.producer = producer
        self.topic = topic
        self.key = key
        self._pending: set[asyncio.Task] = set()

    async def __call__(self, envelope: Envelope) -> None:
        body = envelope.body
        delivery = await self.producer.send(
            self.topic, key=self.key(body), value=body.model_dump_json(exclude_none=True).encode()
        )
        if envelope.delivery.from_record:
            what = f"a message to {self.topic}"
            task = asyncio.ensure_future(envelope.delivery.done_after(delivery, what))
            self._pending.add(task)
            task.add_done_callback(self._pending.discard)

    async def flush(self) -> None:
        if self._pending:
            await asyncio.gather(*list(self._pending), return_exceptions=True)
