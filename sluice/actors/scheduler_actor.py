"""Scheduler actor: decides which runner serves a request.

A session's turns go to the runner that holds its KV blocks: in one process that is the one
runner; across processes the work topic is keyed by session id, so Kafka's partition assignment
keeps a session on one runner (and Redis records the owner, which shows when a partition moved).
Admission is bounded upstream: the consumer pauses its partitions once `max_in_flight` requests
are unfinished, so no queue here grows without bound. Priority is applied inside the engine,
which schedules lower `priority` values first.
"""

from __future__ import annotations

import hashlib
import time

from sluice.actors.errors import error_step
from sluice.actors.messages import Envelope, TokenizedRequest
from sluice.actors.runtime import Actor
from sluice.actors.transport import Sink
from sluice.schemas.events import ErrorCode


def routing_key(work: TokenizedRequest) -> str:
    """Requests of one session share a key (and so a partition and a runner)."""
    request = work.request
    if request.session_id is not None:
        return f"{request.tenant or ''}/{request.session_id}"
    return request.request_id


class SchedulerActor(Actor):
    def __init__(
        self, runners: list[Sink], send_error: Sink, *, name: str = "scheduler", capacity: int = 256
    ):
        super().__init__(name, capacity=capacity)
        if not runners:
            raise ValueError("the scheduler needs at least one runner")
        self.runners = runners
        self.send_error = send_error

    async def handle(self, envelope: Envelope) -> None:
        work: TokenizedRequest = envelope.body
        if work.request.deadline is not None and work.request.deadline < time.time():
            await self.send_error(
                envelope.derive(
                    error_step(
                        work.request,
                        ErrorCode.DEADLINE_EXCEEDED,
                        "deadline: passed before a runner took the request",
                        "deadline",
                    )
                )
            )
            return
        await self.runners[self.pick(work)](envelope)

    def pick(self, work: TokenizedRequest) -> int:
        if len(self.runners) == 1:
            return 0
        digest = hashlib.blake2b(routing_key(work).encode(), digest_size=8).digest()
        return int.from_bytes(digest, "big") % len(self.runners)
