"""Consuming requests: many in flight at once, committed only once they are finished.

aiokafka's auto-commit would commit what was *fetched*; the pipeline needs what was *finished*.
`RequestConsumer` hands out records, the caller marks each one `done(record)` after the record's
final event is written, and `commit_done()` commits, per partition, up to the first record not done
yet (see `offsets.OffsetTracker`). A crash therefore redelivers every unfinished record (and the
finished ones behind it: consumers of the output drop those duplicates by `(request_id, seq)`).

Around that core:

* Backpressure: `pause()` / `resume()` stop and restart fetching of all assigned partitions, and
  `max_in_flight` does the same automatically. The caller keeps calling `poll()` (or iterating)
  while paused: paused partitions return nothing, but the polls tell the group coordinator this
  member is alive, so a long pause never costs a rebalance.
* Rebalances: aiokafka uses the eager protocol, so every rebalance revokes all partitions of the
  member before handing out new ones. On revocation the consumer waits (up to `drain_timeout`)
  for the records of the revoked partitions to be done, commits them and forgets them. A record
  still running when the wait ends is abandoned: the partition's next owner gets it again from the
  committed offset, and its late `done()` is ignored, even when the partition comes back to this
  member (each assignment has its own trackers, and `done()` only accepts the very record object
  the current tracker handed out). From a revocation until the next assignment nothing is
  fetched, and each new assignment starts its partitions at their committed offsets by an
  explicit seek: a record fetched across the rebalance and dropped is read again, never skipped
  (a skipped record would be lost as soon as a later one is committed).
* Shutdown: `stop()` stops fetching, waits for in-flight records (bounded), commits and leaves.
* Static membership (`group_instance_id`, Kafka's group.instance.id): a member restarted under
  the same id takes its partitions back at once, without waiting for the dead one's session to
  expire, and a static member does not leave on `stop()`. Two live processes under one id would
  take the place from each other on every heartbeat (aiokafka's heartbeats do not carry the id, so
  the broker answers "unknown member" rather than "fenced"): a member whose place is taken twice
  within `REPEATED_LOSS_S` stops fetching and raises `MembershipLost`; once is a stall or a broker
  restart, and it joins again.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any

from aiokafka import AIOKafkaConsumer, ConsumerRecord, TopicPartition
from aiokafka.abc import ConsumerRebalanceListener
from aiokafka.errors import CommitFailedError, ConsumerStoppedError, IllegalStateError

from sluice.connectors.kafka_security import kafka_client_options
from sluice.connectors.offsets import OffsetTracker
from sluice.connectors.settings import kafka_bootstrap_servers

log = logging.getLogger(__name__)

# A static member that loses its place twice within this many seconds shares its id with another
# live process (one loss alone may be a stall past the session timeout).
REPEATED_LOSS_S = 60.0


class MembershipLost(RuntimeError):
    """Another live process uses this member's group instance id."""


class _PartitionState:
    """One partition within one assignment: its tracker and the records it handed out."""

    __slots__ = ("tp", "generation", "tracker", "records", "revoking", "start")

    def __init__(self, tp: TopicPartition, generation: int, start: int | None = None) -> None:
        self.tp = tp
        self.generation = generation
        self.tracker = OffsetTracker()
        self.records: dict[int, ConsumerRecord] = {}  # offset -> the record object handed out
        self.revoking = False
        self.start = start  # where this assignment reads from (the committed offset), if known

    @property
    def expected(self) -> int | None:
        """The offset the next record handed out should have (at least)."""
        return self.tracker.next_offset if self.tracker.next_offset is not None else self.start


class _Listener(ConsumerRebalanceListener):
    def __init__(self, owner: RequestConsumer) -> None:
        self._owner = owner

    async def on_partitions_revoked(self, revoked: Iterable[TopicPartition]) -> None:
        await self._owner._on_revoked(set(revoked))

    async def on_partitions_assigned(self, assigned: Iterable[TopicPartition]) -> None:
        await self._owner._on_assigned(set(assigned))


class RequestConsumer:
    """A consumer-group member that commits only finished records. See the module docstring.

    Use as ``async with RequestConsumer(...) as consumer:``, then either
    ``async for record in consumer`` or ``records = await consumer.poll()``; call
    ``consumer.done(record)`` when a record's work is complete and ``await consumer.commit_done()``
    now and then (every second or so) and on shutdown.
    """

    def __init__(
        self,
        topics: str | Sequence[str],
        *,
        group_id: str,
        bootstrap_servers: str | None = None,
        group_instance_id: str | None = None,
        client_id: str = "sluice-consumer",
        max_in_flight: int | None = None,
        low_water: int | None = None,
        drain_timeout: float = 30.0,
        max_poll_records: int = 500,
        poll_timeout: float = 0.5,
        auto_offset_reset: str = "earliest",
        session_timeout_ms: int = 10_000,
        heartbeat_interval_ms: int = 3_000,
        max_poll_interval_ms: int = 300_000,
        rebalance_timeout_ms: int | None = None,
        on_assigned: Callable[[set[TopicPartition]], Awaitable[None]] | None = None,
        on_revoked: Callable[[set[TopicPartition]], Awaitable[None]] | None = None,
        commit_with: Callable[[dict[TopicPartition, int]], Awaitable[None]] | None = None,
        pattern: str | None = None,
        **kafka_options: Any,
    ) -> None:
        self.topics = [topics] if isinstance(topics, str) else list(topics)
        self.group_id = group_id
        self.group_instance_id = group_instance_id
        self._member: str | None = None  # the member id of the last assignment
        self._lost_at: float | None = None  # when a static member last found its place taken
        self._taken: MembershipLost | None = None  # set: its place is another process's
        # A regex of topic names to read instead of `topics` (topics made later are found at the
        # next metadata refresh: metadata_max_age_ms).
        self.pattern = pattern
        if max_in_flight is not None and max_in_flight < 1:
            raise ValueError("max_in_flight must be at least 1")
        if max_in_flight is not None:
            # Resume once a quarter of the room is free again: enough hysteresis not to flap on
            # every finished record, soon enough that the runner does not run dry.
            low_water = max_in_flight * 3 // 4 if low_water is None else low_water
            if not 0 <= low_water < max_in_flight:
                raise ValueError("low_water must be at least 0 and below max_in_flight")
        self.max_in_flight = max_in_flight
        self.low_water = low_water
        # Awaited at every assignment before its records are handed out (state to restore), and
        # at every revocation after its last commit.
        self.on_assigned = on_assigned
        self.on_revoked = on_revoked
        # What commits offsets, instead of the consumer's own commit: a transactional output
        # adds them to its transactions (called every time, with nothing new too: the open
        # transactions commit then).
        self.commit_with = commit_with
        self.drain_timeout = drain_timeout
        self.max_poll_records = max_poll_records
        self.poll_timeout = poll_timeout
        if rebalance_timeout_ms is None:
            # The broker waits this long for members to rejoin; a member draining its revoked
            # partitions must fit in it, or it is dropped from the group mid-drain.
            rebalance_timeout_ms = max(session_timeout_ms, int(drain_timeout * 1000) + 5_000)
        if drain_timeout * 1000 >= max_poll_interval_ms:
            log.warning(
                "drain_timeout %.1fs is not below max_poll_interval_ms %d: a long drain "
                "on stop() may be taken for a dead member",
                drain_timeout,
                max_poll_interval_ms,
            )
        self._config = dict(
            bootstrap_servers=bootstrap_servers or kafka_bootstrap_servers(),
            group_id=group_id,
            group_instance_id=group_instance_id,
            client_id=client_id,
            enable_auto_commit=False,
            auto_offset_reset=auto_offset_reset,
            max_poll_records=max_poll_records,
            session_timeout_ms=session_timeout_ms,
            # a third of the session at most (Kafka's advice), so a short session still holds
            heartbeat_interval_ms=min(heartbeat_interval_ms, session_timeout_ms // 3),
            max_poll_interval_ms=max_poll_interval_ms,
            rebalance_timeout_ms=rebalance_timeout_ms,
            **{**kafka_client_options(), **kafka_options},
        )
        self._consumer: AIOKafkaConsumer | None = None
        self._parts: dict[TopicPartition, _PartitionState] = {}
        self._generation = 0  # bumped on every assignment
        self._buffer: deque[tuple[ConsumerRecord, int]] = deque()  # fetched, not yet handed out
        self._changed = asyncio.Event()  # set whenever a record is done or dropped
        self._manual_pause = False
        self._auto_pause = False
        self._rebalancing = False  # from a revocation until the next assignment: fetch nothing
        self._applied_pause = False
        self._stopping = False
        self._closed = False
        # Counters for metrics.
        self.assignments = 0  # rebalances this member went through (assignments received)
        self.commits = 0  # successful commits that moved at least one offset
        self.abandoned = 0  # records given up at revocation or stop, to be redelivered
        self.stale_done = 0  # done() calls for records no longer tracked (ignored)
        self.pauses = 0  # times max_in_flight paused fetching (backpressure)

    # Lifecycle ---------------------------------------------------------------------------------

    async def start(self) -> None:
        self._consumer = AIOKafkaConsumer(**self._config)
        if self.pattern is not None:
            self._consumer.subscribe(pattern=self.pattern, listener=_Listener(self))
        else:
            self._consumer.subscribe(self.topics, listener=_Listener(self))
        try:
            await self._consumer.start()
        except BaseException:
            await self._consumer.stop()  # release its connections; the error says what failed
            raise
        shown = {k: v for k, v in self._config.items() if "sasl" not in k and "ssl" not in k}
        log.info(
            "consumer started on %s: %s, max_in_flight=%s (resume at %s), drain_timeout=%.1fs",
            f"/{self.pattern}/" if self.pattern is not None else ",".join(self.topics),
            shown,
            self.max_in_flight,
            self.low_water,
            self.drain_timeout,
        )

    async def stop(self, drain: bool = True) -> None:
        """Stop fetching, wait (bounded) for in-flight records, commit them, leave the group.
        Without `drain` (what holds the records has failed: they will not finish) the records
        done so far are committed and the rest left at once."""
        if self._consumer is None or self._closed:
            return
        self._stopping = True
        self._apply_pause()  # no more fetching; records still in flight keep finishing
        self._buffer.clear()
        wait = self.drain_timeout if drain else 0.0
        pending = await self._wait_done(set(self._parts), wait)
        try:
            await self.commit_done()
        except Exception:
            log.exception("final commit failed; uncommitted records will be redelivered")
        if pending:
            self.abandoned += pending
            log.warning(
                "stopped with %d record(s) still in flight after %.1fs: they will be redelivered",
                pending,
                wait,
            )
        self._parts.clear()
        self._closed = True
        if self._taken is not None:
            # its coordinator is held in _on_revoked (a join would take the place back), and
            # aiokafka's stop() waits for it to end by itself: end it here
            routine = self._consumer._coordinator._coordination_task
            routine.cancel()
            await asyncio.gather(routine, return_exceptions=True)
        await self._consumer.stop()
        log.info("consumer stopped (%d commits, %d abandoned)", self.commits, self.abandoned)

    async def __aenter__(self) -> RequestConsumer:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.stop()

    # Getting records ---------------------------------------------------------------------------

    async def poll(
        self, max_records: int | None = None, timeout: float | None = None
    ) -> list[ConsumerRecord]:
        """Fetch up to `max_records` records (waiting up to `timeout` seconds) and hand them out.

        Every record returned is in flight until `done(record)`. Call this regularly even while
        paused: it returns nothing then, but keeps the membership alive.
        """
        records = await self._fetch(max_records, timeout)
        out = []
        for record, generation in records:
            if self._hand_out(record, generation):
                out.append(record)
        self._update_flow()
        return out

    def __aiter__(self) -> RequestConsumer:
        return self

    async def __anext__(self) -> ConsumerRecord:
        while True:
            # Records wait here unregistered: a rebalance drops them without waiting on them, and
            # their offsets lie above every tracked one, so no commit passes them.
            while self._buffer:
                record, generation = self._buffer.popleft()
                if self._hand_out(record, generation):
                    self._update_flow()
                    return record
            if self._stopping or self._closed:
                raise StopAsyncIteration
            # Not `self._buffer.extend(await ...)`: that binds the deque before the await.
            fetched = await self._fetch(None, None)
            self._buffer.extend(fetched)

    async def _fetch(
        self, max_records: int | None, timeout: float | None
    ) -> list[tuple[ConsumerRecord, int]]:
        if self._consumer is None:
            raise RuntimeError("RequestConsumer.start() was not called")
        timeout = self.poll_timeout if timeout is None else timeout
        if self._taken is not None:
            raise self._taken
        if self._stopping or self._closed:
            # Still wait: a caller's `while True: await poll()` must not starve the loop that
            # runs stop(). Loops should end on `consumer.stopping`.
            await asyncio.sleep(timeout)
            return []
        limit = max_records or self.max_poll_records
        if self.max_in_flight is not None:
            # Never fetch past the bound; at the bound the partitions are paused and this poll
            # only keeps the membership alive.
            limit = max(1, min(limit, self.max_in_flight - self.in_flight))
        # The generation when the fetch began: a fetch that spans a rebalance may return records
        # of the new assignment before its callback ran, and those must not pass as its records.
        generation = self._generation
        try:
            batch = await self._consumer.getmany(timeout_ms=int(timeout * 1000), max_records=limit)
        except ConsumerStoppedError:
            return []
        return [(record, generation) for records in batch.values() for record in records]

    def _hand_out(self, record: ConsumerRecord, generation: int) -> bool:
        """Start tracking `record`; False when it is dropped.

        A record is only ever dropped when it will be read again: its partition is being revoked
        or has no assignment callback yet (the next assignment seeks to the committed offset,
        which no commit moved past it), or it was fetched under an earlier assignment than its
        partition's current one (the partition is rewound to the first offset not handed out).
        aiokafka's position moved past a record once it returned it, so a drop without one of
        these would skip it, and the next commit past a later record would lose it.
        """
        tp = TopicPartition(record.topic, record.partition)
        state = self._parts.get(tp)
        if state is None or state.revoking:
            return False
        if state.generation != generation:
            self._rewind(state, record.offset)
            return False
        expected = state.expected
        if expected is not None and record.offset < expected:
            return False  # read again after a rewind, and already handed out
        state.tracker.start(record.offset)
        state.records[record.offset] = record
        return True

    # Finishing and committing ------------------------------------------------------------------

    def done(self, record: ConsumerRecord) -> bool:
        """Mark a record finished (after its final event is written).

        Returns False, and changes nothing, when the record is not in flight under the current
        assignment: done twice, or handed out before its partition was revoked (its next owner
        processes it again).
        """
        if not self.owns(record):
            self.stale_done += 1
            log.debug(
                "ignoring done() for %s:%d at offset %d: not in flight here any more",
                record.topic,
                record.partition,
                record.offset,
            )
            return False
        state = self._parts[TopicPartition(record.topic, record.partition)]
        del state.records[record.offset]
        state.tracker.done(record.offset)
        self._changed.set()
        self._update_flow()
        return True

    def owns(self, record: ConsumerRecord) -> bool:
        """True while `record` is in flight here; False once abandoned at a revocation (its
        partition's next owner processes it again, so work on it may be cut short)."""
        state = self._parts.get(TopicPartition(record.topic, record.partition))
        return state is not None and state.records.get(record.offset) is record

    def committable_offsets(self) -> dict[TopicPartition, int]:
        """Per partition, the offset a commit would store now, where it moved since the last."""
        found = {}
        for tp, state in self._parts.items():
            offset = state.tracker.to_commit()
            if offset is not None:
                found[tp] = offset
        return found

    async def commit_done(
        self, partitions: Iterable[TopicPartition] | None = None
    ) -> dict[TopicPartition, int]:
        """Commit the finished prefix of each partition; returns what was committed.

        A commit refused because the group is rebalancing is logged and skipped: the revocation
        drain commits those partitions itself, or their next owner redelivers.
        """
        if self._consumer is None or self._closed:
            return {}
        offsets = self.committable_offsets()
        if partitions is not None:
            wanted = set(partitions)
            offsets = {tp: o for tp, o in offsets.items() if tp in wanted}
        if not offsets and self.commit_with is None:
            return {}
        # Remember whose offsets these are: a rebalance may replace the states during the await.
        states = {tp: self._parts[tp] for tp in offsets}
        try:
            if self.commit_with is not None:
                await self.commit_with(offsets)
            else:
                await self._consumer.commit(offsets)
        except (CommitFailedError, IllegalStateError) as exc:
            log.warning("commit of %s skipped: %s", _fmt(offsets), exc)
            return {}
        if not offsets:
            return {}
        for tp, offset in offsets.items():
            tracker = states[tp].tracker
            if tracker.committed is None or tracker.committed < offset:
                tracker.committed = offset
        self.commits += 1
        log.debug("committed %s", _fmt(offsets))
        return offsets

    # Backpressure ------------------------------------------------------------------------------

    def pause(self) -> None:
        """Stop fetching all assigned partitions (polling must go on; it returns nothing)."""
        self._manual_pause = True
        self._apply_pause()

    def resume(self) -> None:
        """Undo `pause()`; partitions stay paused while `max_in_flight` holds them."""
        self._manual_pause = False
        self._apply_pause()

    @property
    def stopping(self) -> bool:
        """True once stop() began: poll() returns nothing from then on."""
        return self._stopping or self._closed

    @property
    def paused(self) -> bool:
        """True while fetching is stopped, by `pause()`, by `max_in_flight` or by `stop()`."""
        return self._applied_pause

    @property
    def in_flight(self) -> int:
        """Records handed out and not yet done, over all partitions."""
        return sum(state.tracker.in_flight for state in self._parts.values())

    def in_flight_by_partition(self) -> dict[TopicPartition, int]:
        return {tp: state.tracker.in_flight for tp, state in self._parts.items()}

    def _update_flow(self) -> None:
        if self.max_in_flight is not None:
            assert self.low_water is not None  # __init__ sets it along with max_in_flight
            n = self.in_flight
            if not self._auto_pause and n >= self.max_in_flight:
                self._auto_pause = True
                self.pauses += 1
                log.debug("pausing: %d records in flight (max %d)", n, self.max_in_flight)
            elif self._auto_pause and n <= self.low_water:
                self._auto_pause = False
                log.debug("resuming: %d records in flight (resume at %d)", n, self.low_water)
        self._apply_pause()

    def _apply_pause(self) -> None:
        want = self._manual_pause or self._auto_pause or self._stopping or self._rebalancing
        if self._consumer is None or want == self._applied_pause:
            return
        assigned = self._consumer.assignment()
        if want:
            self._consumer.pause(*assigned)
        else:
            self._consumer.resume(*assigned)
        self._applied_pause = want

    # Rebalances --------------------------------------------------------------------------------

    async def _on_revoked(self, revoked: set[TopicPartition]) -> None:
        # Nothing is fetched until the next assignment (which starts at the committed offsets):
        # records fetched meanwhile would only be dropped again. Fetched records not handed out
        # yet are dropped: the next owner reads them from the committed offset.
        self._rebalancing = True
        self._apply_pause()
        self._drop_buffered(revoked)
        if self._place_taken():
            # Not ours any more: nothing is committed, and the coordinator is held here (no
            # join that would take the place back) until stop() ends it.
            self.abandoned += sum(s.tracker.in_flight for s in self._parts.values())
            self._parts.clear()
            self._changed.set()
            await asyncio.Event().wait()
        states = [self._parts[tp] for tp in revoked if tp in self._parts]
        if not states:
            return  # the first join "revokes" the empty assignment
        for state in states:
            state.revoking = True  # nothing new is handed out for these from here on
        started = time.monotonic()
        pending = await self._wait_done({s.tp for s in states}, self.drain_timeout)
        try:
            committed = await self.commit_done(s.tp for s in states)
        except Exception:
            log.exception(
                "commit on revocation failed; the next owner redelivers from the last "
                "committed offsets"
            )
            committed = {}
        for state in states:
            self._parts.pop(state.tp, None)
        if self.on_revoked is not None:
            try:
                await self.on_revoked({s.tp for s in states})
            except Exception:
                log.exception("closing the state of the revoked partitions failed")
        self._drop_buffered(revoked)  # whatever a fetch in progress added meanwhile
        if pending:
            self.abandoned += pending
            log.warning(
                "revocation of %d partition(s): %d record(s) still in flight after %.1fs "
                "are abandoned and will be redelivered by the next owner",
                len(states),
                pending,
                self.drain_timeout,
            )
        log.info(
            "partitions revoked after %.2fs drain, committed %s",
            time.monotonic() - started,
            _fmt(committed) or "nothing new",
        )
        self._changed.set()
        self._update_flow()

    async def _on_assigned(self, assigned: set[TopicPartition]) -> None:
        # Start each partition at its committed offset, explicitly: records the fetcher returned
        # before this callback ran were dropped (no state yet), and must be read again. Paused
        # meanwhile (a new assignment starts unpaused in aiokafka); _update_flow decides below.
        assert self._consumer is not None  # only the started consumer's listener calls this
        if assigned:
            self._consumer.pause(*assigned)
        self._applied_pause = True
        starts = {}
        for tp in sorted(assigned):
            starts[tp] = await self._start_position(tp)
        self._generation += 1
        self.assignments += 1
        self._member = self._member_id()
        for tp in list(self._parts):
            if tp not in assigned:  # left over from a revocation that did not run
                self._parts.pop(tp)
        for tp in assigned:
            state = self._parts.get(tp)
            if state is None or state.tracker.in_flight == 0:
                self._parts[tp] = _PartitionState(tp, self._generation, starts[tp])
            else:  # kept from a revocation that did not run: its records are still in flight
                state.generation = self._generation
        if self.on_assigned is not None:
            try:
                await self.on_assigned(set(assigned))
            except Exception:
                log.exception("restoring state for the new assignment failed")
        self._rebalancing = False
        self._update_flow()
        log.info(
            "partitions assigned (assignment #%d of this member): %s",
            self._generation,
            ", ".join(f"{tp.topic}:{tp.partition}" for tp in sorted(assigned)) or "none",
        )

    def _member_id(self) -> str:
        # aiokafka keeps it on its coordinator only ("" until joined, and after it was lost)
        coordinator = getattr(self._consumer, "_coordinator", None)
        return getattr(coordinator, "member_id", "") or ""

    def _place_taken(self) -> bool:
        """A static member that had joined and is about to join again without its member id
        (the broker did not know it any more): a stall, or another process under its id. The
        second time within REPEATED_LOSS_S, sets `_taken` and answers True."""
        if self.group_instance_id is None or self._member is None or self._member_id():
            return False
        now = time.monotonic()
        repeated = self._lost_at is not None and now - self._lost_at < REPEATED_LOSS_S
        self._lost_at = now
        if not repeated:
            log.warning(
                "group %s no longer knew this member (instance %s): joining again",
                self.group_id,
                self.group_instance_id,
            )
            return False
        self._taken = MembershipLost(
            f"group {self.group_id}: this member's place (group instance id "
            f"{self.group_instance_id!r}) was taken twice within {REPEATED_LOSS_S:.0f} s: another "
            "live process runs under the same id; give each process its own"
        )
        return True

    async def _start_position(self, tp: TopicPartition) -> int | None:
        """Seek `tp` to where this member should read it from; return that offset."""
        assert self._consumer is not None  # called from _on_assigned
        try:
            committed = await self._consumer.committed(tp)
            if committed is not None:
                self._consumer.seek(tp, committed)
                return committed
            reset = self._config["auto_offset_reset"]
            if reset == "earliest":
                await self._consumer.seek_to_beginning(tp)
            elif reset == "latest":
                await self._consumer.seek_to_end(tp)
            return await asyncio.wait_for(self._consumer.position(tp), 10)
        except Exception:
            log.warning(
                "could not position %s:%d at its committed offset; aiokafka's own reset applies",
                tp.topic,
                tp.partition,
                exc_info=True,
            )
            return None

    def _rewind(self, state: _PartitionState, dropped: int) -> None:
        """Make the consumer read `state`'s partition again from the first offset not handed out
        (or from the `dropped` record's offset, when the assignment's start is unknown)."""
        if not self._stopping:
            assert self._consumer is not None  # records come only from the started consumer
            expected = state.expected
            self._consumer.seek(state.tp, dropped if expected is None else expected)

    def _drop_buffered(self, tps: set[TopicPartition]) -> None:
        """Forget fetched records of `tps` not handed out yet (in place: a fetch may be adding)."""
        kept = [
            item
            for item in self._buffer
            if TopicPartition(item[0].topic, item[0].partition) not in tps
        ]
        self._buffer.clear()
        self._buffer.extend(kept)

    async def _wait_done(self, tps: set[TopicPartition], timeout: float) -> int:
        """Wait until the given partitions have nothing in flight; returns how many still do."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout

        def remaining_records() -> int:
            return sum(self._parts[tp].tracker.in_flight for tp in tps if tp in self._parts)

        while remaining_records() and (wait := deadline - loop.time()) > 0:
            self._changed.clear()
            try:
                await asyncio.wait_for(self._changed.wait(), wait)
            except TimeoutError:
                pass
        return remaining_records()

    # Metrics -----------------------------------------------------------------------------------

    async def lag(self) -> dict[TopicPartition, int]:
        """Per assigned partition: records behind the end of the log (highwater - position).

        Partitions not fetched from yet (highwater unknown) are left out.
        """
        if self._consumer is None or self._closed:
            return {}
        result = {}
        for tp in self._consumer.assignment():
            try:
                highwater = self._consumer.highwater(tp)
                if highwater is None:
                    continue
                position = await asyncio.wait_for(self._consumer.position(tp), 1.0)
            except (AssertionError, IllegalStateError, TimeoutError):
                continue  # revoked or not positioned yet
            result[tp] = max(0, highwater - position)
        return result

    def assignment(self) -> set[TopicPartition]:
        return set(self._consumer.assignment()) if self._consumer is not None else set()


async def commit_or_skip(consumer: AIOKafkaConsumer, offsets: dict[TopicPartition, int]) -> bool:
    """Commit `offsets`, for a plain consumer's loop; when a rebalance took the partitions away
    meanwhile, log and skip: their next owner reads those records again."""
    try:
        await consumer.commit(offsets)
    except (CommitFailedError, IllegalStateError) as exc:
        log.warning("commit of %s skipped: %s", _fmt(offsets), exc)
        return False
    return True


def _fmt(offsets: dict[TopicPartition, int]) -> str:
    return ", ".join(f"{tp.topic}:{tp.partition}@{o}" for tp, o in sorted(offsets.items()))
