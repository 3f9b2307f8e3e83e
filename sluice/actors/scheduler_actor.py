"""Scheduler actor: decides which runner serves a request.

A session's turns go to the runner that holds its KV blocks: in one process that is the one
runner; across processes, by default (`--routing session`), the work topic is keyed by session id,
so Kafka's partition assignment keeps a session on one runner (and Redis records the owner, which
shows when a partition moved). With `--routing kv` each runner reads a work topic of its own and
the scheduler sends each request to the runner holding the longest cached prefix of its prompt,
as the runners' KV events tell (`kv_router.py`); `--routing round-robin` takes turns instead.
Admission is bounded upstream: the consumer pauses its partitions once `max_in_flight` requests
are unfinished, so no queue here grows without bound. Priority is applied inside the engine,
which schedules lower `priority` values first.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Callable

from sluice.actors.errors import error_step
from sluice.actors.kv_router import KvRouter
from sluice.actors.messages import Envelope, TokenizedRequest
from sluice.actors.metrics import Metrics
from sluice.actors.runtime import Actor
from sluice.actors.transport import Sink
from sluice.schemas.events import ErrorCode

log = logging.getLogger(__name__)


def routing_key(work: TokenizedRequest) -> str:
    """Requests of one session share a key (and so a partition and a runner)."""
    request = work.request
    if request.session_id is not None:
        return f"{request.tenant or ''}/{request.session_id}"
    return request.request_id


class SchedulerActor(Actor):
    """Sends each request to one of `runners`, or, with a `router`, to the work topic of the
    runner it chooses (`work_topic(topic)` is the sink for that topic)."""

    def __init__(
        self,
        runners: list[Sink],
        send_error: Sink,
        *,
        router: KvRouter | None = None,
        work_topic: Callable[[str], Sink] | None = None,
        metrics: Metrics | None = None,
        name: str = "scheduler",
        capacity: int = 256,
    ):
        super().__init__(name, capacity=capacity)
        if not runners and router is None:
            raise ValueError("the scheduler needs at least one runner")
        if router is not None and work_topic is None:
            raise ValueError("a router needs work_topic, the sink of each runner's topic")
        self.runners = runners
        self.send_error = send_error
        self.router = router
        self.work_topic = work_topic
        self.metrics = metrics

    async def handle(self, envelope: Envelope[TokenizedRequest]) -> None:
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
        if self.router is None:
            await self.runners[self.pick(work)](envelope)
            return
        assert self.work_topic is not None
        key = routing_key(work)
        choice = self.router.choose(work, key)
        while choice is None:
            log.warning("no runner is alive: request %s waits for one", work.request.request_id)
            await self.router.wait_for_runner()
            choice = self.router.choose(work, key)
        if self.metrics is not None:
            self.metrics.routed.labels(choice.runner_id, choice.why).inc()
            self.metrics.routed_cached_blocks.labels(choice.runner_id).inc(choice.cached_blocks)
        log.debug(
            "request %s to %s (%s, %d blocks cached)",
            work.request.request_id,
            choice.runner_id,
            choice.why,
            choice.cached_blocks,
        )
        await self.work_topic(choice.work_topic)(envelope)

    def pick(self, work: TokenizedRequest) -> int:
        if len(self.runners) == 1:
            return 0
        digest = hashlib.blake2b(routing_key(work).encode(), digest_size=8).digest()
        return int.from_bytes(digest, "big") % len(self.runners)
