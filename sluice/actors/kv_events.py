"""KV events: each runner tells the schedulers which prefix blocks it holds and how loaded it is.

On `PREFIX.kv-events`, keyed by runner id (so one runner's messages stay in order):

- after an engine step that changed the prefix cache, the blocks it stored and evicted;
- every `heartbeat_s`, its load (running and waiting requests, free KV blocks), even when idle:
  a runner whose messages stop is taken for gone;
- every `snapshot_every_s`, and first of all, every block it holds: a scheduler that starts
  later reads back one snapshot interval and has the whole picture;
- when it stops (drained and out of its consumer group), that it is leaving: it is no longer
  routed to at once, and what is left in its work topic is moved (`failover.py`).

A block is named by the first 8 bytes of its chained prefix hash (which carries the tenant's
salt): plenty to tell the blocks of a few runners apart, and a wrong match only costs a cache
miss. The hashes travel as base64 of their concatenation, 11 characters a block.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Iterable

from pydantic import BaseModel, ConfigDict, Field

from sluice.engine.kv_events import KvEvents

log = logging.getLogger(__name__)

HASH_BYTES = 8
HEARTBEAT_S = 1.0
SNAPSHOT_EVERY_S = 30.0


def short_hash(block_hash: bytes) -> bytes:
    return block_hash[:HASH_BYTES]


def pack_hashes(hashes: Iterable[bytes]) -> str:
    return base64.b64encode(b"".join(short_hash(h) for h in hashes)).decode("ascii")


def unpack_hashes(packed: str) -> list[bytes]:
    raw = base64.b64decode(packed)
    if len(raw) % HASH_BYTES:
        raise ValueError(f"packed hashes of {len(raw)} bytes, not a multiple of {HASH_BYTES}")
    return [raw[i : i + HASH_BYTES] for i in range(0, len(raw), HASH_BYTES)]


class RunnerLoad(BaseModel):
    model_config = ConfigDict(extra="ignore")

    running: int = 0  # requests the runner holds (in its engine, or about to be)
    waiting: int = 0  # of those, not yet scheduled by the engine
    free_blocks: int = 0
    num_blocks: int = 0


class KvEventsMessage(BaseModel):
    """One runner's report: its load, and how its prefix cache changed (or all of it)."""

    model_config = ConfigDict(extra="ignore")

    runner_id: str
    work_topic: str  # where requests for this runner go
    work_group: str = ""  # the consumer group reading it: who takes its requests over if it dies
    kind: str = "unified"  # "unified", or "prefill" / "decode" (prefill/decode separation)
    incarnation: str  # new each time the runner starts: its earlier cache is gone
    seq: int  # per incarnation: 0, 1, 2, ...
    sent_at: float  # unix time
    block_size: int
    load: RunnerLoad = Field(default_factory=RunnerLoad)
    snapshot: bool = False  # `stored` is every block the runner holds: forget what was known
    stored: str = ""  # packed hashes (pack_hashes)
    removed: str = ""
    leaving: bool = False  # its last message: the runner stopped


class KvEventPublisher:
    """Turns a runner's engine steps and heartbeats into KV event messages, in order."""

    def __init__(
        self,
        send: Callable[[KvEventsMessage], Awaitable[None]],
        *,
        runner_id: str,
        work_topic: str,
        work_group: str,
        block_size: int,
        kind: str = "unified",
        heartbeat_s: float = HEARTBEAT_S,
        snapshot_every_s: float = SNAPSHOT_EVERY_S,
    ):
        self._send = send
        self.runner_id = runner_id
        self.work_topic = work_topic
        self.work_group = work_group
        self.kind = kind
        self.block_size = block_size
        self.heartbeat_s = heartbeat_s
        self.snapshot_every_s = snapshot_every_s
        self.incarnation = uuid.uuid4().hex[:12]
        self._seq = 0
        self._last_sent = 0.0  # monotonic
        self._last_snapshot: float | None = None  # monotonic; None: none sent yet
        self._lock = asyncio.Lock()  # one message at a time, so their order is their seq's
        self._left = False  # after `leave`, nothing more is sent

    def snapshot_due(self) -> bool:
        last = self._last_snapshot
        return last is None or time.monotonic() - last >= self.snapshot_every_s

    def heartbeat_due(self) -> bool:
        return time.monotonic() - self._last_sent >= self.heartbeat_s

    async def snapshot(self, hashes: list[bytes], load: RunnerLoad) -> None:
        self._last_snapshot = time.monotonic()
        await self._publish(load, snapshot=True, stored=pack_hashes(hashes))

    async def changes(self, events: KvEvents, load: RunnerLoad) -> None:
        if events:
            stored, removed = pack_hashes(events.stored), pack_hashes(events.removed)
            await self._publish(load, stored=stored, removed=removed)

    async def heartbeat(self, load: RunnerLoad) -> None:
        await self._publish(load)

    async def leave(self) -> None:
        """Say that the runner stopped; later messages are not sent."""
        await self._publish(RunnerLoad(), leaving=True)
        self._left = True

    async def _publish(self, load: RunnerLoad, **blocks) -> None:
        async with self._lock:
            if self._left:
                return
            message = KvEventsMessage(
                runner_id=self.runner_id,
                work_topic=self.work_topic,
                work_group=self.work_group,
                kind=self.kind,
                incarnation=self.incarnation,
                seq=self._seq,
                sent_at=time.time(),
                block_size=self.block_size,
                load=load,
                **blocks,
            )
            self._seq += 1
            self._last_sent = time.monotonic()
            await self._send(message)
