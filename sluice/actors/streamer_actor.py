"""Streamer actor: publishes step messages as the client's events and remembers sessions.

Token events go out as soon as they arrive (the idempotent producer keeps them in order per
partition: the reply topic is keyed by request id). A final or error event is awaited until Kafka
has it, and so is every token event of its request before it; only then is the session written
to Redis, and the input record acknowledged, so its offset is committed only after every event of
the request is durable.

Text deltas, stop strings and usage are computed by the engine, which sees the tokens first; the
streamer formats (as sluice's events or as OpenAI's objects: `schemas/openai_events.py`),
publishes and records. A request that does not stream gets its final event alone; its token
messages still carry the progress records written with them.
"""

from __future__ import annotations

import asyncio
import logging

from sluice.actors.answered import AnsweredInputs
from sluice.actors.messages import Envelope, StepMessage
from sluice.actors.metrics import Metrics
from sluice.actors.runtime import Actor
from sluice.connectors.kafka_producer import EventProducer
from sluice.connectors.sessions import SessionStore
from sluice.connectors.transactions import NotOwned, PartitionTransactions
from sluice.schemas import ErrorEvent, FinalEvent, TokenEvent, TokenLogprob, encode, openai_events
from sluice.schemas.events import Choice, ErrorCode, Failure

log = logging.getLogger(__name__)


class StreamerActor(Actor):
    def __init__(
        self,
        producer: EventProducer | PartitionTransactions,
        tokens_topic: str,
        sessions: SessionStore | None,
        *,
        metrics: Metrics | None = None,
        dlq_topic: str | None = None,
        answered: AnsweredInputs | None = None,
        event_format: str = "sluice",
        name: str = "streamer",
        capacity: int = 1024,
    ):
        super().__init__(name, capacity=capacity)
        self.producer = producer
        self.tokens_topic = tokens_topic
        self.sessions = sessions
        self.metrics = metrics
        self.dlq_topic = dlq_topic
        self.event_format = event_format  # for requests that do not say (request.event_format)
        # Exactly-once: where requests answered by an error event alone are marked.
        self.answered = answered
        self._finishing: set[asyncio.Task] = set()
        self._token_deliveries: dict[str, list[asyncio.Future]] = {}  # request id -> unawaited

    async def handle(self, envelope: Envelope[StepMessage]) -> None:
        try:
            await self._publish(envelope)
        except NotOwned:
            # Exactly-once, and the request's input partition moved to another member: what it
            # produces here is no longer part of any transaction; its new owner resumes it.
            log.info("dropping a message of %s: its partition moved away", envelope.body.request_id)

    async def _publish(self, envelope: Envelope[StepMessage]) -> None:
        message: StepMessage = envelope.body
        if message.published:
            self._track(self._finish_request(None, envelope))
            return
        topic = message.request.reply_topic or self.tokens_topic
        event: ErrorEvent | TokenEvent | FinalEvent
        if message.error is not None:
            event = message.error.model_copy(update={"seq": message.seq})
            value = self._encode(message, event)
        elif not message.finished:
            if not message.request.stream:  # its tokens go out on the final event alone
                written = await self._send(envelope, topic, None)
                self._after_token(envelope, written)
                return
            event = TokenEvent(
                request_id=message.request_id,
                seq=message.seq,
                index=message.index,
                token_ids=message.token_ids,
                text=message.text if message.content is None else message.content,
                logprobs=message.logprobs,
                tool_calls=message.tool_calls,
                reasoning=message.reasoning,
                session_id=message.request.session_id,
            )
            written = await self._send(envelope, topic, self._encode(message, event))
            self._after_token(envelope, written)
            return
        else:
            event = FinalEvent(
                request_id=message.request_id,
                seq=message.seq,
                finish_reason=message.finish_reason,
                stop_reason=message.stop_reason,
                usage=message.usage,
                timings=message.timings,
                model=message.request.model,
                text=(message.full_text or "") if message.content is None else message.content,
                tool_calls=message.tool_calls,
                reasoning=message.reasoning,
                choices=[
                    Choice(**c, logprobs=self._logprobs_of(message, c["index"]))
                    for c in message.choices
                ]
                if message.choices
                else None,
                logprobs=None if message.choices else self._logprobs_of(message, 0),
                seed=message.seed,
                provenance=message.provenance,
                error=Failure(code=ErrorCode.INTERNAL, message=message.failure)
                if message.failure
                else None,
                session_id=message.request.session_id,
                metadata=message.request.metadata,
            )
            value = self._encode(message, event)
        written = await self._send(envelope, topic, value)
        if message.dead_letter is not None and self.dlq_topic is not None:
            letter = ErrorEvent(
                request_id=message.request_id,
                code=ErrorCode.INTERNAL,
                message=message.failure or "dead-lettered",
                session_id=message.request.session_id,
                metadata=message.request.metadata,
            )
            letter = letter.with_raw(message.dead_letter.encode())
            self._token_deliveries.setdefault(message.request_id, []).append(
                await self.producer.send(
                    self.dlq_topic,
                    key=message.request_id,
                    value=encode(letter),
                    origin=envelope.delivery.origin,
                )
            )
        self._track(self._finish_request(written, envelope))

    def _encode(self, message: StepMessage, event: TokenEvent | FinalEvent | ErrorEvent) -> bytes:
        """The event as the request wants it: sluice's own, or OpenAI's objects."""
        if not openai_events.wants_openai(message.request.event_format, self.event_format):
            return encode(event)
        if isinstance(event, ErrorEvent):
            return openai_events.dump(openai_events.error_object(event))
        request = message.request
        shape = openai_events.OpenAIShape(request.chat, request.created, request.model)
        if isinstance(event, TokenEvent):
            return openai_events.dump(
                openai_events.token_chunk(event, shape, message.position == 0)
            )
        if not message.request.stream:
            logprobs = message.choice_logprobs
            return openai_events.dump(openai_events.whole(event, shape, logprobs))
        return openai_events.dump(openai_events.last_chunk(event, shape))

    @staticmethod
    def _logprobs_of(message: StepMessage, index: int) -> list[TokenLogprob] | None:
        """A completion's logprobs on the final event, when no token event carried them."""
        if message.choice_logprobs is None:
            return None
        return message.choice_logprobs.get(index, [])

    def _after_token(self, envelope: Envelope[StepMessage], written: asyncio.Future) -> None:
        if envelope.delivery.from_record:  # one record per token message when roles run apart
            what = f"a token event of {envelope.body.request_id}"
            self._track(envelope.delivery.done_after(written, what))
        else:
            self._token_deliveries.setdefault(envelope.body.request_id, []).append(written)

    async def _send(
        self, envelope: Envelope[StepMessage], topic: str, value: bytes | None
    ) -> asyncio.Future:
        """The message's event (None: no event), with the records that must be written in one
        piece with it."""
        key = envelope.body.request_id
        writes = envelope.writes
        if envelope.body.error is not None:
            # A request rejected before the engine: its error event is all it gets; marked with
            # it, so that the request delivered again after a crash is not answered twice.
            writes = [*writes, *envelope.delivery.marker(self.answered)]
        if value is None and not writes:
            done: asyncio.Future = asyncio.get_running_loop().create_future()
            done.set_result(None)
            return done
        if not writes:
            origin = envelope.delivery.origin
            return await self.producer.send(topic, key=key, value=value, origin=origin)
        assert isinstance(self.producer, PartitionTransactions)
        records = [*writes] + ([(topic, key, value)] if value is not None else [])
        return (await self.producer.send_together(envelope.delivery.origin, records))[-1]

    def _track(self, coro) -> None:
        task = asyncio.ensure_future(coro)
        self._finishing.add(task)
        task.add_done_callback(self._finishing.discard)

    async def _finish_request(
        self, written: asyncio.Future | None, envelope: Envelope[StepMessage]
    ) -> None:
        """Once every event of the request is durable (`written`: its final's; None when it
        was published before): its session turn, then its input is done."""
        message: StepMessage = envelope.body
        tokens = self._token_deliveries.pop(message.request_id, [])
        try:
            for future in [*tokens, *([written] if written is not None else [])]:
                await future
        except Exception:
            log.exception(
                "an event of %s was not delivered; its request stays uncommitted",
                message.request_id,
            )
            return
        request = message.request
        if request.session_id is not None and self.sessions is not None:
            if message.session_token_ids is not None:
                recorded = await self.sessions.record_turn(
                    request.tenant,
                    request.session_id,
                    message.request_id,
                    message.session_messages or [],
                    message.session_token_ids,
                    message.session_start or (0, 0),
                    owner=request.runner_id,
                    model=request.model,
                )
                if not recorded:
                    log.warning(
                        "turn %s of session %s not recorded (Redis unavailable): the session's "
                        "next turn will not continue it",
                        message.request_id,
                        request.session_id,
                    )
            else:  # it ended without an answer to remember: the next turn need not wait
                await self.sessions.end_turn(request.tenant, request.session_id, message.request_id)
        envelope.delivery.done()
        if not message.published:  # (counted when it was)
            self._record(message)

    def _record(self, message: StepMessage) -> None:
        if self.metrics is None:
            return
        m = self.metrics
        if message.error is not None:
            m.requests.labels(message.error.code).inc()
            return
        m.requests.labels("ok" if message.finish_reason != "abort" else "abort").inc()
        if message.usage:
            m.tokens.inc(message.usage.completion_tokens)
            m.prompt_tokens.inc(message.usage.prompt_tokens)
            m.cached_tokens.inc(message.usage.cached_tokens)
        if message.timings:
            t = message.timings
            m.e2e.observe(t.total_s)
            m.queue_time.observe(t.queue_s)
            if t.in_topic_s is not None:
                m.in_topic.observe(t.in_topic_s)
            if t.ttft_s is not None:
                m.ttft.observe(t.ttft_s)
            if t.tpot_s is not None:
                m.tpot.observe(t.tpot_s)
        if self.sessions is not None:
            m.redis_available.set(1 if self.sessions.available else 0)

    async def on_stop(self) -> None:
        if self._finishing:
            await asyncio.gather(*list(self._finishing), return_exceptions=True)
        await self.producer.flush()
