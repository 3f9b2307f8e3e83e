"""Reads a Kafka topic into the first actor, commits what is finished, and turns undecodable input
into error events so that bad input never stops a partition.

The consumer pauses its partitions once `max_in_flight` records are unfinished (backpressure) and
keeps polling so the group does not evict it; records are acknowledged out of order and committed
as the contiguous finished prefix of each partition. Once a commit passes an acknowledged record,
`on_committed` learns its request id: that request will not be delivered again (its progress
record can go).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from aiokafka.structs import ConsumerRecord, TopicPartition
from pydantic import BaseModel, ValidationError

from sluice.actors.answered import AnsweredInputs
from sluice.actors.delivery import Delivery
from sluice.actors.messages import Envelope, Work
from sluice.actors.metrics import Metrics
from sluice.actors.reply_topics import ReplyTopics
from sluice.actors.transport import Sink
from sluice.connectors.kafka_consumer import RequestConsumer
from sluice.connectors.kafka_producer import EventProducer
from sluice.connectors.transactions import PartitionTransactions
from sluice.schemas import (
    ErrorEvent,
    GenerateRequest,
    RequestRejected,
    decode_request,
    encode,
    openai_events,
)
from sluice.schemas.events import ErrorCode

log = logging.getLogger(__name__)

COMMIT_INTERVAL_S = 1.0


class Ingress:
    """One consumer feeding one sink.

    `decode` turns a record's bytes into the message for the sink; it raises RequestRejected (with
    a ready error event) for client input, or ValidationError for a malformed internal message.
    """

    def __init__(
        self,
        consumer: RequestConsumer,
        producer: EventProducer | PartitionTransactions,
        deliver: Sink,
        *,
        tokens_topic: str,
        dlq_topic: str,
        decode: Callable[[bytes], Work] = decode_request,
        metrics: Metrics | None = None,
        on_committed: Callable[[list[tuple[str, TopicPartition]]], Awaitable[None]] | None = None,
        reply_topics: ReplyTopics | None = None,
        commit_interval_s: float = COMMIT_INTERVAL_S,
        answered: AnsweredInputs | None = None,
        event_format: str = "sluice",
        tenant_of: Callable[[str], str | None] | None = None,
    ):
        self.consumer = consumer
        self.producer = producer
        self.deliver = deliver
        self.tokens_topic = tokens_topic
        self.dlq_topic = dlq_topic
        self.decode = decode
        self.metrics = metrics
        self._tasks: set[asyncio.Task] = set()
        self._pauses_reported = 0  # consumer.pauses already counted in the metrics
        self.on_committed = on_committed
        self.reply_topics = reply_topics
        self.commit_interval_s = commit_interval_s
        # Exactly-once: where inputs answered by an error event alone are marked, so that one
        # delivered again (a crash before its offset was committed) is not answered twice.
        self.answered = answered
        self._acked: list[tuple[TopicPartition, int, str]] = []  # done, not yet known committed
        self.event_format = event_format  # of an error event whose request does not choose
        # The tenant a topic's name decides (per-tenant request topics), or None.
        self.tenant_of = tenant_of

    async def run(self) -> None:
        """Consume until the consumer stops; commits finished records every second."""
        committer = asyncio.ensure_future(self._commit_loop())
        try:
            async for record in self.consumer:
                await self._handle(record)
        finally:
            committer.cancel()

    async def _handle(self, record: ConsumerRecord) -> None:
        origin = TopicPartition(record.topic, record.partition)
        if self.answered is not None and self.answered.answered(origin, record.offset):
            log.info(
                "input at %s[%d]@%d was answered before (its answer is committed)",
                record.topic,
                record.partition,
                record.offset,
            )
            self.consumer.done(record)
            return
        try:
            body = self.decode(record.value or b"")
        except RequestRejected as rejected:
            openai = openai_events.wants_openai(rejected.event_format, self.event_format)
            self._spawn(self._publish_error(record, rejected.event, rejected.reply_topic, openai))
            return
        except (ValidationError, ValueError) as exc:
            event = ErrorEvent(
                code=ErrorCode.INTERNAL, message=f"malformed internal message: {exc}"
            )
            self._spawn(self._publish_error(record, event, None, False))
            return
        if self.tenant_of is not None and isinstance(body, GenerateRequest):
            tenant = self.tenant_of(record.topic)
            if tenant is not None:
                if body.tenant not in (None, tenant):
                    event = ErrorEvent.for_request(
                        body,
                        ErrorCode.INVALID_REQUEST,
                        f"tenant: a request on {record.topic} is tenant {tenant!r}'s; it cannot "
                        f"act as tenant {body.tenant!r}",
                        field="tenant",
                    )
                    openai = openai_events.wants_openai(body.event_format, self.event_format)
                    self._spawn(self._publish_error(record, event, body.reply_topic, openai))
                    return
                body = body.model_copy(update={"tenant": tenant})
        delivery = Delivery(
            self._finished,
            origin=origin,
            offset=record.offset,
            received_at=time.time(),
            published_at=record.timestamp / 1000 if record.timestamp >= 0 else None,
            record=record,
            request_id=_request_id_of(body),
        )
        await self.deliver(Envelope(body, delivery))

    def _finished(self, delivery: Delivery) -> None:
        """A record's output is durable: it may be committed (and, once it is, reported)."""
        if self.consumer.done(delivery.record) and delivery.request_id is not None:
            if self.on_committed is not None and delivery.origin is not None:
                self._acked.append((delivery.origin, delivery.record.offset, delivery.request_id))

    async def _report_committed(self, committed: dict[TopicPartition, int]) -> None:
        """Tell `on_committed` which acknowledged requests a commit has now passed."""
        if committed and self.answered is not None:
            await self.answered.forget(committed)
        if not self._acked or not committed or self.on_committed is None:
            return
        passed = [(rid, tp) for tp, offset, rid in self._acked if offset < committed.get(tp, -1)]
        self._acked = [a for a in self._acked if not a[1] < committed.get(a[0], -1)]
        if passed:
            await self.on_committed(passed)

    async def _publish_error(
        self, record: ConsumerRecord, event: ErrorEvent, reply_topic: str | None, openai: bool
    ) -> None:
        """Client-visible error for bad input: to the reply topic when the request id could be
        read (as OpenAI's error object when `openai`), else to the dead-letter topic with the raw
        bytes. Then the offset may be committed."""
        if reply_topic is not None and self.reply_topics is not None:
            if await self.reply_topics.check(reply_topic) is not None:
                reply_topic = None  # not one to send to: the default stream instead
        if event.request_id is not None:
            topic, key = reply_topic or self.tokens_topic, event.request_id
            event = event.model_copy(update={"seq": 0})
        else:
            topic, key, openai = self.dlq_topic, None, False
            if event.raw is None:
                event = event.with_raw(record.value or b"")
        value = openai_events.dump(openai_events.error_object(event)) if openai else encode(event)
        log.info(
            "rejected input at %s[%d]@%d: %s: %s",
            record.topic,
            record.partition,
            record.offset,
            event.code,
            event.message,
        )
        origin = TopicPartition(record.topic, record.partition)
        try:
            if self.answered is not None and isinstance(self.producer, PartitionTransactions):
                marker = self.answered.mark(origin, record.offset)
                records = [*marker, (topic, key, value)]
                await (await self.producer.send_together(origin, records))[-1]
            else:
                await self.producer.send_and_wait(topic, key=key, value=value, origin=origin)
        except Exception:
            log.exception(
                "could not publish the error event for %s[%d]@%d; it will be retried after a "
                "restart",
                record.topic,
                record.partition,
                record.offset,
            )
            return
        if self.metrics:
            self.metrics.requests.labels(event.code).inc()
        self.consumer.done(record)

    def _spawn(self, coro) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _commit_loop(self) -> None:
        while True:
            await asyncio.sleep(self.commit_interval_s)
            try:
                await self._report_committed(await self.consumer.commit_done())
                if self.metrics:
                    self.metrics.in_flight.set(self.consumer.in_flight)
                    self.metrics.paused.set(1 if self.consumer.paused else 0)
                    self.metrics.pauses.inc(self.consumer.pauses - self._pauses_reported)
                    self._pauses_reported = self.consumer.pauses
                    for tp, lag in (await self.consumer.lag()).items():
                        self.metrics.consumer_lag.labels(tp.topic, str(tp.partition)).set(lag)
            except Exception:
                log.warning(
                    "periodic commit failed; retrying in %.1f s",
                    self.commit_interval_s,
                    exc_info=True,
                )

    async def drain_errors(self) -> None:
        if self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)


def _request_id_of(body: BaseModel) -> str | None:
    """The request a message belongs to (a request itself, or an actor's message about one)."""
    request_id = getattr(body, "request_id", None)
    if request_id is None and hasattr(body, "request"):
        request_id = getattr(body.request, "request_id", None)
    return request_id
