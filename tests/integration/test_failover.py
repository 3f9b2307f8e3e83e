"""Failover's moving part on the real broker, without a model: the unfinished records of a dead
runner's work topic (past its group's committed offset) go, in order and marked as taken over, to
the live runner's topic; the dead runner's group is committed past them; when the runner comes
back the takeover leaves its group, and the runner reads on from where the move stopped."""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest
from aiokafka import AIOKafkaConsumer, TopicPartition

from sluice.actors.failover import RunnerFailover
from sluice.actors.kv_events import KvEventsMessage
from sluice.actors.kv_router import KvRouter
from sluice.actors.messages import TokenizedRequest
from sluice.connectors.kafka_producer import EventProducer
from sluice.connectors.topics import ensure_topics
from sluice.schemas import GenerateRequest

pytestmark = pytest.mark.integration


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def report(runner: str, prefix: str, incarnation: str = "a") -> KvEventsMessage:
    return KvEventsMessage(
        runner_id=runner,
        work_topic=f"{prefix}.work.{runner}",
        work_group=f"{prefix}-runner-{runner}",
        incarnation=incarnation,
        seq=0,
        sent_at=time.time(),
        block_size=16,
    )


def work(i: int) -> bytes:
    request = GenerateRequest(request_id=f"req-{i}", prompt="x", max_tokens=4)
    tokenized = TokenizedRequest(request=request, prompt_token_ids=[1, 2, i], received_at=1.0)
    return tokenized.model_dump_json().encode()


async def read(
    bootstrap: str, topic: str, count: int, group: str | None = None, timeout: float = 60
) -> list:
    consumer = AIOKafkaConsumer(
        topic,
        bootstrap_servers=bootstrap,
        group_id=group,
        auto_offset_reset="earliest",
        enable_auto_commit=False,
    )
    await consumer.start()
    got: list = []
    try:
        deadline = time.monotonic() + timeout
        while len(got) < count and time.monotonic() < deadline:
            for records in (await consumer.getmany(timeout_ms=500)).values():
                got += records
    finally:
        await consumer.stop()
    return got


async def committed(bootstrap: str, group: str, tp: TopicPartition) -> int | None:
    consumer = AIOKafkaConsumer(
        bootstrap_servers=bootstrap, group_id=group, enable_auto_commit=False
    )
    await consumer.start()
    try:
        return await consumer.committed(tp)
    finally:
        await consumer.stop()


async def test_a_dead_runners_unfinished_requests_move_to_a_live_one(bootstrap_servers):
    prefix = f"fo{uuid.uuid4().hex[:8]}"
    dead_topic, live_topic = f"{prefix}.work.r-dead", f"{prefix}.work.r-live"
    dead_group = f"{prefix}-runner-r-dead"
    await ensure_topics(bootstrap_servers, {dead_topic: 1, live_topic: 1})
    tp = TopicPartition(dead_topic, 0)
    async with EventProducer(bootstrap_servers=bootstrap_servers) as producer:
        for i in range(5):
            await producer.send_and_wait(dead_topic, key=f"k{i}", value=work(i))
        # The runner had finished the first two: its group committed offset 2.
        marker = AIOKafkaConsumer(
            bootstrap_servers=bootstrap_servers, group_id=dead_group, enable_auto_commit=False
        )
        await marker.start()
        marker.assign([tp])
        await marker.commit({tp: 2})
        await marker.stop()

        clock = Clock()
        router = KvRouter(dead_after_s=5, clock=clock)
        router.apply(report("r-dead", prefix))
        router.apply(report("r-live", prefix))
        failover = RunnerFailover(router, producer, bootstrap_servers, check_every_s=0.1)
        task = asyncio.ensure_future(failover.run())
        try:
            await asyncio.sleep(0.5)
            # both alive: nothing moves
            assert await read(bootstrap_servers, live_topic, 1, timeout=1) == []
            clock.now += 6
            router.apply(report("r-live", prefix))  # only r-live still reports
            moved = await read(bootstrap_servers, live_topic, 3)
            takes = [TokenizedRequest.model_validate_json(r.value) for r in moved]
            assert [t.request.request_id for t in takes] == ["req-2", "req-3", "req-4"]
            assert {t.taken_over_from for t in takes} == {"r-dead"}
            deadline = time.monotonic() + 30
            while await committed(bootstrap_servers, dead_group, tp) != 5:
                assert time.monotonic() < deadline, "the move was not committed"
                await asyncio.sleep(0.5)

            # Back: the takeover leaves the group; the runner reads what came after the move.
            router.apply(report("r-dead", prefix, incarnation="b"))
            await producer.send_and_wait(dead_topic, key="k5", value=work(5))
            (later,) = await read(bootstrap_servers, dead_topic, 1, group=dead_group)
            assert later.offset == 5
            # nothing else moved
            assert len(await read(bootstrap_servers, live_topic, 4, timeout=2)) == 3
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
