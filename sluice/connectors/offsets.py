"""Which input offset of one partition may be committed, when records finish out of order.

The pipeline works on many records of a partition at once and finishes them in any order (a short
prompt overtakes a long one). Kafka keeps one committed offset per partition, and everything below
it counts as processed: committing the offset after the newest finished record would lose the
older ones still running if the process died. So the committable offset is the lowest offset handed
out and not yet done; when nothing is pending, the one after the newest record handed out.

Only offsets actually handed out count. Offsets a partition skips (compacted records, transaction
markers) never block the commit, and records fetched but not yet handed out lie above every offset
tracked here, so a commit never passes them.
"""

from __future__ import annotations

from collections import deque


class OffsetTracker:
    """Offsets of one partition handed out in increasing order and finished in any order.

    Amortized O(1) per record: pending offsets sit in a queue in the order they were handed out;
    finished ones stay in it until everything before them is finished too.
    """

    __slots__ = ("_queue", "_running", "_next", "committed")

    def __init__(self) -> None:
        self._queue: deque[int] = deque()  # handed out and not yet released, ascending
        self._running: set[int] = set()  # handed out and not yet done
        self._next: int | None = None  # one past the newest offset handed out
        self.committed: int | None = None  # the last offset committed for this partition

    def start(self, offset: int) -> None:
        """Record that `offset` was handed out for processing."""
        if self._next is not None and offset < self._next:
            # Within one assignment Kafka delivers a partition in order; going back would mean a
            # seek, and the committable offset could then move backwards.
            raise ValueError(
                f"offset {offset} handed out after {self._next - 1}: offsets must increase"
            )
        self._queue.append(offset)
        self._running.add(offset)
        self._next = offset + 1

    def done(self, offset: int) -> bool:
        """Mark `offset` finished; False when it is not running (unknown or already done)."""
        if offset not in self._running:
            return False
        self._running.discard(offset)
        # Release the run of finished offsets now at the front of the queue.
        queue = self._queue
        while queue and queue[0] not in self._running:
            queue.popleft()
        return True

    @property
    def next_offset(self) -> int | None:
        """One past the newest offset handed out; None before the first."""
        return self._next

    def is_running(self, offset: int) -> bool:
        """True when `offset` was handed out and is not done yet."""
        return offset in self._running

    @property
    def in_flight(self) -> int:
        """Records handed out and not yet done."""
        return len(self._running)

    def committable(self) -> int | None:
        """The offset to commit (the next record to process after a restart); None before any."""
        if self._queue:
            return self._queue[0]
        return self._next

    def to_commit(self) -> int | None:
        """The committable offset when it moved past the last commit, else None."""
        offset = self.committable()
        if offset is None or (self.committed is not None and offset <= self.committed):
            return None
        return offset
