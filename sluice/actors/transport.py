"""How an actor's output reaches the next actor: a mailbox in one process, a Kafka topic across
processes. Actors only see a `Sink`, so the same actor code runs both ways."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from pydantic import BaseModel

from sluice.actors.messages import Envelope, no_ack
from sluice.connectors.kafka_producer import EventProducer

log = logging.getLogger(__name__)

Sink = Callable[[Envelope], Awaitable[None]]


class KafkaSink:
    """Publishes each message to a topic; acknowledges the input only once Kafka has it."""

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
        if envelope.ack is not no_ack:
            task = asyncio.ensure_future(self._ack_after(delivery, envelope))
            self._pending.add(task)
            task.add_done_callback(self._pending.discard)

    async def _ack_after(self, delivery, envelope: Envelope) -> None:
        try:
            await delivery
        except Exception:
            # Not acknowledged: the input is redelivered after a restart, never lost.
            log.exception("delivery to %s failed; its input stays uncommitted", self.topic)
            return
        envelope.ack()

    async def flush(self) -> None:
        if self._pending:
            await asyncio.gather(*list(self._pending), return_exceptions=True)
