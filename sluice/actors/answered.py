"""Exactly-once across a hop whose input offsets can lag behind its output.

A partition's input offsets are committed as its contiguous finished prefix, so a record answered
quickly behind one still being served has its output committed (in one transaction) before its
offset (in a later one). A crash between the two delivers it again; answered again, a
read_committed consumer would see its output twice. So where a request's one answer is an error
event (bad input, a request rejected before the engine), the event is written with a marker under
the input's position, in one piece of the same transaction, and an input delivered again whose
marker is there is only committed. A marker is tombstoned once a commit has passed its offset.
(Where a request has many outputs, its token events, the progress changelog does this job:
`actors.progress`.) The markers live in the progress topic.
"""

from __future__ import annotations

import logging

from aiokafka.structs import TopicPartition

from sluice.connectors.changelog import Changelog

log = logging.getLogger(__name__)

PREFIX = "answered"


def _key(tp: TopicPartition, offset: int) -> str:
    # Three spaces: no request id (none has a space) or progress token key (one) has this form.
    return f"{PREFIX} {tp.topic} {tp.partition} {offset}"


class AnsweredInputs:
    def __init__(self, changelog: Changelog):
        self.changelog = changelog  # read (started, caught up) and stopped by its owner
        self._offsets: dict[TopicPartition, set[int]] = {}  # the markers this table holds

    def reindex(self) -> None:
        """Know the markers the changelog holds, after it was read (at start, and on each
        assignment: what the partitions' earlier owners wrote)."""
        self._offsets = {}
        for key in self.changelog.keys():
            if key.startswith(PREFIX + " "):
                _, topic, partition, offset = key.split(" ")
                tp = TopicPartition(topic, int(partition))
                self._offsets.setdefault(tp, set()).add(int(offset))

    def answered(self, tp: TopicPartition, offset: int) -> bool:
        """Whether the input at (tp, offset) was answered in a committed transaction."""
        return self.changelog.get(_key(tp, offset)) is not None

    def mark(self, tp: TopicPartition, offset: int) -> list[tuple[str, str, bytes | None]]:
        """The marker of the input at (tp, offset), as (topic, key, value) records to write in one
        piece with its answer."""
        self._offsets.setdefault(tp, set()).add(offset)
        return self.changelog.stage({_key(tp, offset): b"1"})

    async def forget(self, committed: dict[TopicPartition, int]) -> None:
        """Tombstone the markers that the committed offsets have passed."""
        for tp, offset in committed.items():
            passed = sorted(o for o in self._offsets.get(tp, ()) if o < offset)
            if not passed:
                continue
            self._offsets[tp].difference_update(passed)
            try:
                await self.changelog.delete(*(_key(tp, o) for o in passed), origin=tp)
            except Exception:  # noqa: BLE001 - a missed tombstone costs a stale record, no more
                log.warning("tombstoning %d answered marker(s) failed", len(passed), exc_info=True)
