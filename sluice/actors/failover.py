"""Failover of routed runners: what a dead runner had not finished goes to the live ones.

With `--routing kv` or `round-robin` every runner reads a work topic of its own, and commits a
request's offset there only once its final event is written. When a runner dies, its unfinished
requests are the records of its work topic past its group's committed offsets. The scheduler
notices the death (`KvRouter`: no KV events for `dead_after_s`, or a `leaving` message), joins
the dead runner's consumer group in its place, and moves each of those records, marked
`taken_over_from`, to the runner the router now chooses, committing in the dead runner's group
once the new topic has it. The runner that receives one reads the progress changelog first, so
the request resumes after what was published (DELIVERY.md) and the session moves with it.

Joining the group (not reading it from outside) lets Kafka keep this honest: the takeover gets the
partitions only once the dead member's session has expired, commits are fenced by the group's
generation, and several schedulers doing the same split the partitions between them instead of
moving a record twice. When the runner comes back (a new incarnation in its KV events) the
takeover leaves its group and the runner reads on from what was moved.
"""

from __future__ import annotations

import asyncio
import logging

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.errors import CommitFailedError, KafkaError

from sluice.actors.kv_router import Choice, KvRouter, RunnerView
from sluice.actors.messages import TokenizedRequest
from sluice.actors.metrics import Metrics
from sluice.actors.scheduler_actor import routing_key
from sluice.connectors.kafka_producer import EventProducer
from sluice.connectors.kafka_security import kafka_client_options

log = logging.getLogger(__name__)

CHECK_EVERY_S = 0.5


class RunnerFailover:
    def __init__(
        self,
        router: KvRouter,
        producer: EventProducer,
        bootstrap_servers: str,
        *,
        metrics: Metrics | None = None,
        check_every_s: float = CHECK_EVERY_S,
    ):
        self.router = router
        self.producer = producer
        self.bootstrap_servers = bootstrap_servers
        self.metrics = metrics
        self.check_every_s = check_every_s
        # runner id -> (the incarnation taken over, the task moving its requests)
        self._takeovers: dict[str, tuple[str, asyncio.Task]] = {}

    async def run(self) -> None:
        """Watch the runners: take over the dead ones' work topics, give them back on return."""
        try:
            while True:
                self._check()
                await asyncio.sleep(self.check_every_s)
        finally:
            await self.stop()

    def _check(self) -> None:
        for view in list(self.router.runners.values()):
            held = self._takeovers.get(view.runner_id)
            if self.router.is_live(view):
                if held is not None and (held[0] != view.incarnation or held[1].done()):
                    log.info("runner %s is back: handing its work topic back", view.runner_id)
                    self._takeovers.pop(view.runner_id)[1].cancel()
            elif held is None and view.work_group:
                log.warning(
                    "runner %s is gone (%s): moving its unfinished requests to the live runners",
                    view.runner_id,
                    "it stopped" if view.left else "its KV events stopped",
                )
                task = asyncio.ensure_future(self._take_over(view))
                self._takeovers[view.runner_id] = (view.incarnation, task)

    async def stop(self) -> None:
        tasks = [task for _, task in self._takeovers.values()]
        self._takeovers.clear()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _take_over(self, dead: RunnerView) -> None:
        consumer = AIOKafkaConsumer(
            dead.work_topic,
            group_id=dead.work_group,
            bootstrap_servers=self.bootstrap_servers,
            client_id=f"sluice-failover-{dead.runner_id}",
            enable_auto_commit=False,
            auto_offset_reset="earliest",
            **kafka_client_options(),
        )
        while True:
            try:
                await consumer.start()
                break
            except KafkaError as exc:
                log.warning("taking over %s: %s; trying again in 1 s", dead.work_topic, exc)
                await asyncio.sleep(1.0)
        try:
            while True:
                fetched = await consumer.getmany(timeout_ms=1000)
                for tp, records in fetched.items():
                    if not await self._move(dead, tp, records, consumer):
                        return  # it is back
        finally:
            await consumer.stop()

    def _choose(self, work: TokenizedRequest, key: str) -> Choice | None:
        """A request a prefill runner had passed on goes to another decode runner if there is
        one (any runner can continue it); the others as new requests go."""
        if work.handoff is not None:
            return self.router.choose_decode(work, key) or self.router.choose(work, key)
        return self.router.choose(work, key)

    async def _move(self, dead: RunnerView, tp: TopicPartition, records, consumer) -> bool:
        """Move the records to live runners and commit them; False, moving only those before it,
        when the router chooses the dead runner itself again (it came back)."""
        deliveries, done, back = [], None, False
        for record in records:
            try:
                work = TokenizedRequest.model_validate_json(record.value)
            except ValueError as exc:
                log.error(
                    "a record of %s at offset %d does not parse; skipped: %s",
                    tp,
                    record.offset,
                    exc,
                )
                done = record.offset + 1
                continue
            work = work.model_copy(update={"taken_over_from": dead.runner_id})
            key = routing_key(work)
            choice = self._choose(work, key)
            while choice is None:
                await self.router.wait_for_runner()
                choice = self._choose(work, key)
            if choice.runner_id == dead.runner_id:
                back = True
                break
            value = work.model_dump_json(exclude_none=True).encode()
            deliveries.append(await self.producer.send(choice.work_topic, key=key, value=value))
            log.info(
                "request %s moved from runner %s to %s",
                work.request.request_id,
                dead.runner_id,
                choice.runner_id,
            )
            if self.metrics is not None:
                self.metrics.routed.labels(choice.runner_id, "failover").inc()
                self.metrics.failover_moved.labels(dead.runner_id).inc()
            done = record.offset + 1
        for delivery in deliveries:
            await delivery
        if done is not None:
            try:
                await consumer.commit({tp: done})
            except CommitFailedError as exc:
                # The group moved on (the runner came back): the records are read again by
                # whoever has the partition now; a request delivered twice is resumed, not
                # served twice.
                log.warning("moved records of %s not committed: %s", tp, exc)
        return not back
