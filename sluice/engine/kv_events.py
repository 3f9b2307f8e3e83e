"""What the prefix cache gained and lost since it was last asked: the runner publishes it so that
a router can send each request where its prefix is cached.

A block is named by its chained prefix hash (`block_manager.hash_block`), which already carries
the tenant's salt, so two runners holding the same hash hold the same tokens under the same
tenant. Recording is off until a caller turns it on (`LLMEngine.record_kv_events`): nobody drains
the log otherwise, and it would only grow.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class KvEvents:
    """The net change since the last batch: each hash is in one list at most, so the two can be
    applied in either order."""

    stored: list[bytes] = field(default_factory=list)
    removed: list[bytes] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.stored or self.removed)


class KvEventLog:
    """Collects the block manager's cache changes until `take` hands them over."""

    def __init__(self) -> None:
        self._present: dict[bytes, bool] = {}  # hash -> cached after its last change

    def stored(self, block_hash: bytes) -> None:
        self._present[block_hash] = True

    def removed(self, block_hash: bytes) -> None:
        self._present[block_hash] = False

    def take(self) -> KvEvents:
        changes, self._present = self._present, {}
        events = KvEvents()
        for block_hash, present in changes.items():
            (events.stored if present else events.removed).append(block_hash)
        return events
