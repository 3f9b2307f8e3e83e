"""When an input is done: one `Delivery` per record read from Kafka.

Ingress makes a delivery for each record it hands on; every envelope that follows from the record
carries it, through the tokenizer, scheduler and runner, until the actor that writes the record's
last output (the streamer, or a `KafkaSink` when roles run apart) calls `done()` or
`done_after(future)`. Only then does ingress mark the record finished, so that its offset can be
committed: an input is never committed before its output is durable.

The delivery is also where the record's place is known: `origin` is the partition whose
transaction its outputs join (exactly-once), `marker()` the record that says it was answered.
Work that did not come from a record (tests, in-process callers, a runner's own messages) carries
a `Delivery()` with nothing to tell: its `done()` changes nothing outside it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from aiokafka.structs import TopicPartition

if TYPE_CHECKING:
    from sluice.actors.answered import AnsweredInputs

log = logging.getLogger(__name__)


class Delivery:
    """One input record on its way to done; `on_done(delivery)` is told once, when it is."""

    def __init__(
        self,
        on_done: Callable[[Delivery], None] | None = None,
        *,
        origin: TopicPartition | None = None,
        offset: int | None = None,
        received_at: float = 0.0,
        published_at: float | None = None,
        record: Any = None,
        request_id: str | None = None,
    ):
        self._on_done = on_done
        self.origin = origin  # the input partition: its transaction, with exactly-once delivery
        self.offset = offset  # of the record in `origin`: where it stands in its order
        self.received_at = received_at  # unix time the record was read
        self.published_at = published_at  # the record's timestamp (when the client sent it)
        self.record = record  # what ingress needs back when it is done (its consumer record)
        self.request_id = request_id  # the request the record belongs to, when it names one
        self._copies: list[Delivery] = []
        self._done = False

    @property
    def from_record(self) -> bool:
        """Whether some record waits for this delivery (False for `Delivery()`)."""
        return self._on_done is not None

    def for_part(self) -> Delivery:
        """For a message that is only part of the record's output (a token message): the same
        place (its transaction), and nothing waits for it."""
        return Delivery(origin=self.origin, offset=self.offset)

    def also(self, copy: Delivery) -> None:
        """A copy of the same request, delivered again while this one runs (a rebalance): done
        with this one. Done now, its offset could be committed while the request still runs;
        never done, it would hold its partition's commits back for good."""
        if self._done:
            copy.done()
        else:
            self._copies.append(copy)

    def done(self) -> None:
        """The record's output is durable: it may be committed. Said once; later calls do
        nothing."""
        if self._done:
            return
        self._done = True
        if self._on_done is not None:
            self._on_done(self)
        copies, self._copies = self._copies, []
        for copy in copies:
            copy.done()

    async def done_after(self, written: asyncio.Future, what: str) -> bool:
        """`done()` once `written` (the write of its last output) succeeds. A failed write leaves
        the record unfinished: it is delivered again after a restart, never lost."""
        try:
            await written
        except Exception:
            log.exception("%s not written; its input stays uncommitted", what)
            return False
        self.done()
        return True

    def marker(self, answered: AnsweredInputs | None) -> list[tuple[str, str, bytes | None]]:
        """The records that say this input was answered (exactly-once: written with its error
        event, so that the input delivered again is not answered twice); none without a place."""
        if answered is None or self.origin is None or self.offset is None:
            return []
        return answered.mark(self.origin, self.offset)

    def position(self) -> tuple[str, int, int] | None:
        """(topic, partition, offset) of the record, or None when it did not come from one."""
        if self.origin is None or self.offset is None:
            return None
        return (self.origin.topic, self.origin.partition, self.offset)
