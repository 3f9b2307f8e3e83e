"""The Kafka connectors against the real broker: topic creation, the idempotent producer, and a
consumer that commits only finished records, pauses without leaving its group, and drains on
rebalance and stop."""

from __future__ import annotations

import asyncio
import logging
import random
import uuid

import pytest
from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient

from sluice.connectors.kafka_consumer import MembershipLost, RequestConsumer
from sluice.connectors.kafka_producer import EventProducer
from sluice.connectors.topics import delete_topics_with_prefix, ensure_topics

pytestmark = pytest.mark.integration

# Fast group timing so joins and rebalances take a second, not ten.
FAST = dict(heartbeat_interval_ms=300, session_timeout_ms=6_000, poll_timeout=0.2)


def unique(prefix: str) -> str:
    return f"{prefix}.{uuid.uuid4().hex[:10]}"


async def new_topic(bootstrap: str, partitions: int) -> str:
    name = unique("test.conn")
    await ensure_topics(bootstrap, {name: partitions})
    return name


async def produce(bootstrap: str, topic: str, count: int, partitions: int, start: int = 0) -> None:
    async with EventProducer(bootstrap_servers=bootstrap) as producer:
        futures = [
            await producer.send(topic, f"k{i}", str(i).encode(), partition=i % partitions)
            for i in range(start, start + count)
        ]
        await producer.flush()
        for future in futures:
            await future


def consumer(bootstrap: str, topic: str, group: str, **options) -> RequestConsumer:
    return RequestConsumer(
        topic, bootstrap_servers=bootstrap, group_id=group, **{**FAST, **options}
    )


async def poll_n(c: RequestConsumer, n: int, timeout: float = 20.0) -> list:
    """Poll until exactly n records were handed out (fails after `timeout`)."""
    got: list = []
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while len(got) < n:
        assert loop.time() < deadline, f"only {len(got)} of {n} records within {timeout}s"
        got.extend(await c.poll(max_records=n - len(got)))
    return got


async def group_offsets(bootstrap: str, group: str) -> dict[int, int]:
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        offsets = await admin.list_consumer_group_offsets(group)
    finally:
        await admin.close()
    return {tp.partition: meta.offset for tp, meta in offsets.items()}


async def wait_for(condition, timeout: float, what: str) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not condition():
        assert loop.time() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


async def test_ensure_topics_creates_missing_tolerates_existing_and_warns_on_fewer(
    bootstrap_servers, caplog
):
    three, one = unique("test.topics"), unique("test.topics")
    # Two callers at once: one creates, the other meets TopicAlreadyExists and goes on.
    results = await asyncio.gather(
        ensure_topics(bootstrap_servers, {three: 3, one: 1}),
        ensure_topics(bootstrap_servers, {three: 3, one: 1}),
    )
    assert results == [{three: 3, one: 1}] * 2
    assert await ensure_topics(bootstrap_servers, {three: 3}) == {three: 3}

    with caplog.at_level(logging.WARNING, logger="sluice.connectors.topics"):
        assert await ensure_topics(bootstrap_servers, {three: 5}) == {three: 3}  # not grown
    assert f"topic {three} has 3 partition(s), fewer than the 5 configured" in caplog.text

    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap_servers)
    await admin.start()
    try:
        described = {
            t["topic"]: len(t["partitions"]) for t in await admin.describe_topics([three, one])
        }
    finally:
        await admin.close()
    assert described == {three: 3, one: 1}


async def test_a_runs_topics_are_deleted_by_their_prefix_and_no_others(bootstrap_servers):
    prefix = unique("test.prune")
    mine = [f"{prefix}.requests", f"{prefix}.tokens"]
    neighbour = f"{prefix}x.requests"  # shares the characters, not the prefix
    await ensure_topics(bootstrap_servers, {name: 1 for name in [*mine, neighbour]})
    assert await delete_topics_with_prefix(bootstrap_servers, prefix) == mine
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap_servers)
    await admin.start()
    try:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 30
        while set(mine) & set(await admin.list_topics()):  # deletion completes asynchronously
            assert loop.time() < deadline, "topics still listed 30 s after their deletion"
            await asyncio.sleep(0.2)
        assert neighbour in await admin.list_topics()
    finally:
        await admin.close()
    assert await delete_topics_with_prefix(bootstrap_servers, prefix) == []


async def test_producer_writes_keys_headers_in_order(bootstrap_servers):
    topic = await new_topic(bootstrap_servers, 1)
    async with EventProducer(bootstrap_servers=bootstrap_servers) as producer:
        futures = [
            await producer.send(
                topic, "req-1", f"delta {i}".encode(), headers={"seq": str(i), "raw": b"\x00\x01"}
            )
            for i in range(20)
        ]
        metadata = [await f for f in futures]
        last = await producer.send_and_wait(topic, b"req-1", b"final")
    assert [m.offset for m in metadata] == list(range(20)) and last.offset == 20

    reader = AIOKafkaConsumer(
        topic, bootstrap_servers=bootstrap_servers, auto_offset_reset="earliest"
    )
    await reader.start()
    try:
        records = []
        while len(records) < 21:
            for batch in (await reader.getmany(timeout_ms=1000)).values():
                records.extend(batch)
    finally:
        await reader.stop()
    assert [r.value for r in records] == [f"delta {i}".encode() for i in range(20)] + [b"final"]
    assert {r.key for r in records} == {b"req-1"}
    assert records[3].headers == (("seq", b"3"), ("raw", b"\x00\x01"))


async def test_out_of_order_completion_then_restart_redelivers_from_first_unfinished(
    bootstrap_servers,
):
    topic, group = await new_topic(bootstrap_servers, 2), unique("group")
    await produce(bootstrap_servers, topic, 40, partitions=2)
    rnd = random.Random(4)

    first = consumer(bootstrap_servers, topic, group, drain_timeout=0.2)
    async with first:
        records = await poll_n(first, 40)
        unfinished = {(r.partition, r.offset) for r in rnd.sample(records, 5)}
        finished = [r for r in records if (r.partition, r.offset) not in unfinished]
        rnd.shuffle(finished)  # completion order has nothing to do with offsets
        for record in finished:
            assert first.done(record)
        assert first.in_flight == 5
        committed = await first.commit_done()
    # Stopping with records in flight abandons them: they are not committed.
    assert first.abandoned == 5
    first_unfinished = {p: min([o for q, o in unfinished if q == p] or [20]) for p in (0, 1)}
    assert {tp.partition: o for tp, o in committed.items()} == {
        p: o for p, o in first_unfinished.items() if o > 0
    }
    assert await group_offsets(bootstrap_servers, group) == {
        p: o for p, o in first_unfinished.items() if o > 0
    }

    second = consumer(bootstrap_servers, topic, group)
    async with second:
        expected = {(p, o) for p in (0, 1) for o in range(first_unfinished[p], 20)}
        again = await poll_n(second, len(expected))
        again += await second.poll(timeout=1.0)  # and nothing more
        for record in again:
            second.done(record)
    redelivered = {(r.partition, r.offset) for r in again}
    assert len(again) == len(redelivered) == len(expected)
    assert redelivered == expected
    assert unfinished <= redelivered  # every unfinished record comes back
    # Finished records below the first unfinished one of their partition do not.
    assert not any(o < first_unfinished[p] for p, o in redelivered)


async def test_pause_stops_delivery_while_polling_keeps_the_member_in_the_group(bootstrap_servers):
    topic, group = await new_topic(bootstrap_servers, 1), unique("group")
    await produce(bootstrap_servers, topic, 10, partitions=1)
    # A poll interval far shorter than the pause: without polling the member would be dropped.
    c = consumer(bootstrap_servers, topic, group, max_poll_interval_ms=1_500, drain_timeout=1.0)
    async with c:
        for record in await poll_n(c, 10):
            c.done(record)
        await c.commit_done()
        c.pause()
        assert c.paused
        await produce(bootstrap_servers, topic, 10, partitions=1, start=10)
        loop = asyncio.get_running_loop()
        until = loop.time() + 4.0
        while loop.time() < until:
            assert await c.poll(timeout=0.2) == []
        assert c.assignments == 1  # no rebalance happened during the pause
        c.resume()
        rest = await poll_n(c, 10)
        assert [r.offset for r in rest] == list(range(10, 20))
        assert c.assignments == 1


async def test_max_in_flight_pauses_at_the_bound_and_resumes_at_low_water(bootstrap_servers):
    topic, group = await new_topic(bootstrap_servers, 1), unique("group")
    await produce(bootstrap_servers, topic, 30, partitions=1)
    c = consumer(bootstrap_servers, topic, group, max_in_flight=8, low_water=4, drain_timeout=0.2)
    async with c:
        held = await poll_n(c, 8)
        for _ in range(5):  # polling on hands out nothing beyond the bound
            assert await c.poll(timeout=0.1) == []
        assert c.in_flight == 8 and c.paused
        for record in held[:3]:
            c.done(record)
        assert c.in_flight == 5 and c.paused  # above low water: still paused
        c.done(held[3])
        assert c.in_flight == 4 and not c.paused
        more = await poll_n(c, 4)
        assert [r.offset for r in more] == [8, 9, 10, 11]
        assert c.in_flight == 8 and c.paused
        assert await c.lag() == {TopicPartition(topic, 0): 30 - 12}


async def test_second_consumer_joining_mid_stream_loses_and_duplicates_nothing(bootstrap_servers):
    partitions, total = 4, 200
    topic, group = await new_topic(bootstrap_servers, partitions), unique("group")
    await produce(bootstrap_servers, topic, total, partitions=partitions)
    processed: list[tuple[str, int, int]] = []
    stop = asyncio.Event()
    rnd = random.Random(7)

    async def work(name: str, c: RequestConsumer, record) -> None:
        await asyncio.sleep(rnd.uniform(0.05, 0.15))  # generation takes a while
        processed.append((name, record.partition, record.offset))  # "final event written"
        c.done(record)

    async def run(name: str, c: RequestConsumer) -> None:
        tasks = set()
        async with c:
            while not stop.is_set():
                for record in await c.poll():
                    task = asyncio.create_task(work(name, c, record))
                    tasks.add(task)
                    task.add_done_callback(tasks.discard)
                await c.commit_done()
            await asyncio.gather(*tasks)

    a = consumer(bootstrap_servers, topic, group, max_in_flight=5)
    b = consumer(bootstrap_servers, topic, group, max_in_flight=5)
    runner_a = asyncio.create_task(run("a", a))
    await wait_for(lambda: len(processed) >= 40, 20, "a to process 40 records")
    runner_b = asyncio.create_task(run("b", b))
    await wait_for(lambda: len(processed) >= total, 40, "all records")
    await asyncio.sleep(1.0)  # room for any duplicate to show up
    stop.set()
    await asyncio.gather(runner_a, runner_b)

    seen = [(p, o) for _, p, o in processed]
    assert len(seen) == total and set(seen) == {
        (i % partitions, i // partitions) for i in range(total)
    }
    assert a.assignments >= 2 and b.assignments >= 1  # a rebalanced when b joined
    assert a.abandoned == b.abandoned == 0
    assert any(name == "b" for name, _, _ in processed)
    assert await group_offsets(bootstrap_servers, group) == {
        p: total // partitions for p in range(partitions)
    }


async def test_revocation_drain_timeout_abandons_and_late_done_is_not_committed(bootstrap_servers):
    topic, group = await new_topic(bootstrap_servers, 1), unique("group")
    await produce(bootstrap_servers, topic, 5, partitions=1)
    a = consumer(bootstrap_servers, topic, group, drain_timeout=0.5)
    b = consumer(bootstrap_servers, topic, group)
    redelivered: list = []
    stop = asyncio.Event()

    async def keep_polling(c: RequestConsumer) -> None:
        while not stop.is_set():
            for record in await c.poll():
                redelivered.append(record)
                c.done(record)
                await c.commit_done()

    async with a:
        records = await poll_n(a, 5)
        a.done(records[0])
        a.done(records[1])
        async with b:
            pollers = [asyncio.create_task(keep_polling(c)) for c in (a, b)]
            await wait_for(lambda: a.assignments == 2 and b.assignments == 1, 20, "the rebalance")
            # Records 2..4 outlived the drain: abandoned, redelivered to the partition's owner
            # (which may be a again, under a new assignment).
            await wait_for(lambda: len(redelivered) >= 3, 20, "the redelivery")
            assert a.abandoned == 3
            assert not a.done(records[2])  # late completion of an abandoned record is ignored
            assert a.stale_done == 1
            stop.set()
            await asyncio.gather(*pollers)
    assert sorted(r.offset for r in redelivered) == [2, 3, 4]
    assert await group_offsets(bootstrap_servers, group) == {0: 5}


async def test_partition_coming_back_to_the_same_member_ignores_its_abandoned_records(
    bootstrap_servers,
):
    topic, other = await new_topic(bootstrap_servers, 1), await new_topic(bootstrap_servers, 1)
    group = unique("group")
    await produce(bootstrap_servers, topic, 3, partitions=1)
    a = consumer(bootstrap_servers, topic, group, drain_timeout=0.5)
    # b shares the group but reads another topic: its joining rebalances a, which gets its
    # partition straight back under a new assignment.
    b = consumer(bootstrap_servers, other, group)
    async with a:
        old = await poll_n(a, 3)
        assert a.done(old[0])
        async with b:
            again = []
            loop = asyncio.get_running_loop()
            deadline = loop.time() + 20
            while len(again) < 2:
                assert loop.time() < deadline, "no redelivery"
                again += await a.poll()
            assert a.assignments == 2 and a.abandoned == 2
            assert [r.offset for r in again] == [1, 2]
            # The late completions of the first delivery must not count for the second one.
            assert not a.done(old[1]) and not a.done(old[2])
            assert a.in_flight == 2
            assert a.committable_offsets() == {TopicPartition(topic, 0): 1}  # where it restarted
            assert a.done(again[0])
            assert await a.commit_done() == {TopicPartition(topic, 0): 2}
            assert a.done(again[1])
            assert await a.commit_done() == {TopicPartition(topic, 0): 3}


async def test_async_iteration_counts_only_records_handed_out(bootstrap_servers):
    topic, group = await new_topic(bootstrap_servers, 1), unique("group")
    await produce(bootstrap_servers, topic, 5, partitions=1)
    async with consumer(bootstrap_servers, topic, group) as c:
        got = []
        async for record in c:
            # The rest of the fetched batch waits unregistered: only this one is in flight.
            assert c.in_flight == 1
            got.append(record.offset)
            c.done(record)
            if len(got) == 3:
                break
        assert await c.commit_done() == {TopicPartition(topic, 0): 3}
        async for record in c:
            got.append(record.offset)
            c.done(record)
            if len(got) == 5:
                break
    assert got == [0, 1, 2, 3, 4]
    assert await group_offsets(bootstrap_servers, group) == {0: 5}


async def test_rebalances_while_iterating_at_the_bound_lose_nothing(bootstrap_servers):
    """The pipeline's way of consuming (async iteration, work finishing later, max_in_flight
    reached) while the group rebalances again and again: every record is handed out and
    committed. A regression: a rebalance during a fetch used to drop the fetched records (the
    fetch appended them to a buffer the revocation had replaced), then a commit passed them."""
    partitions, total = 4, 400
    topic, other = (
        await new_topic(bootstrap_servers, partitions),
        await new_topic(bootstrap_servers, 1),
    )
    group = unique("group")
    await produce(bootstrap_servers, topic, total, partitions=partitions)
    handed: list[tuple[int, int]] = []
    rnd = random.Random(11)
    c = consumer(bootstrap_servers, topic, group, max_in_flight=8, drain_timeout=10)

    async def work(record) -> None:
        await asyncio.sleep(rnd.uniform(0.05, 0.1))  # the bound is reached: fetches wait paused
        c.done(record)

    async def consume() -> None:
        tasks = set()
        async for record in c:
            handed.append((record.partition, record.offset))
            task = asyncio.create_task(work(record))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            await asyncio.sleep(0.002)  # handing over to the next actor takes a moment
        await asyncio.gather(*tasks)

    async def commit_every_so_often() -> None:
        while True:
            await asyncio.sleep(0.2)
            await c.commit_done()

    async def intrude() -> None:
        # Another member joins the group (on another topic) and leaves: two rebalances a time.
        while True:
            async with consumer(bootstrap_servers, other, group) as visitor:
                await visitor.poll(timeout=0.2)
            await asyncio.sleep(0.1)

    async with c:
        jobs = [asyncio.create_task(job()) for job in (consume, commit_every_so_often, intrude)]
        try:
            await wait_for(lambda: len(set(handed)) >= total, 60, "every record")
        finally:
            for job in jobs[1:]:
                job.cancel()
            await asyncio.gather(*jobs[1:], return_exceptions=True)
        await wait_for(lambda: c.in_flight == 0, 10, "the last records")
        await c.commit_done()
        rebalances = c.assignments
    jobs[0].cancel()
    await asyncio.gather(jobs[0], return_exceptions=True)

    assert rebalances >= 4
    assert set(handed) == {(i % partitions, i // partitions) for i in range(total)}
    assert await group_offsets(bootstrap_servers, group) == {
        p: total // partitions for p in range(partitions)
    }


async def test_stop_waits_for_in_flight_records_then_commits(bootstrap_servers):
    topic, group = await new_topic(bootstrap_servers, 1), unique("group")
    await produce(bootstrap_servers, topic, 5, partitions=1)
    c = consumer(bootstrap_servers, topic, group, drain_timeout=10.0)
    await c.start()
    records = await poll_n(c, 5)

    async def finish_later() -> None:
        await asyncio.sleep(0.5)
        for record in reversed(records):
            c.done(record)

    finisher = asyncio.create_task(finish_later())
    await c.stop()
    assert finisher.done() and c.abandoned == 0
    assert await group_offsets(bootstrap_servers, group) == {0: 5}


async def test_two_live_members_under_one_instance_id_end_with_one_stopped_and_named(
    bootstrap_servers,
):
    """aiokafka lets two processes under one group.instance.id take the place from each other on
    every heartbeat, both reading the same partitions; the consumer stops one of them with
    MembershipLost, and the other goes on reading its records."""
    topic, group = await new_topic(bootstrap_servers, 2), unique("group")
    await produce(bootstrap_servers, topic, 4, partitions=2)
    first = consumer(bootstrap_servers, topic, group, group_instance_id="runner-1")
    second = consumer(bootstrap_servers, topic, group, group_instance_id="runner-1")
    await first.start()
    for record in await poll_n(first, 4):
        first.done(record)
    await second.start()
    lost: dict[str, MembershipLost] = {}
    read = {"first": 0, "second": 0}

    async def keep_polling(name: str, member: RequestConsumer) -> None:
        try:
            while True:
                for record in await member.poll():
                    member.done(record)
                    read[name] += 1
        except MembershipLost as e:
            lost[name] = e

    tasks = [
        asyncio.ensure_future(keep_polling(n, m)) for n, m in (("first", first), ("second", second))
    ]
    try:
        await wait_for(lambda: lost, 45, "a member to find its id shared")
        await asyncio.sleep(8)  # more than a session: the one left keeps its place
        assert len(lost) == 1, lost
        assert "runner-1" in str(next(iter(lost.values())))
        name = "second" if "first" in lost else "first"
        survivor = second if name == "second" else first
        assert not tasks[0 if survivor is first else 1].done()
        assert len(survivor.assignment()) == 2
        before = read[name]
        await produce(bootstrap_servers, topic, 2, partitions=2, start=4)
        await wait_for(lambda: read[name] >= before + 2, 20, "the survivor to read on")
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for member in (first, second):
            await member.stop(drain=False)


async def test_static_member_restarting_with_its_instance_id_resumes(bootstrap_servers):
    topic, group = await new_topic(bootstrap_servers, 1), unique("group")
    await produce(bootstrap_servers, topic, 6, partitions=1)
    for expected in ([0, 1, 2], [3, 4, 5]):
        c = consumer(bootstrap_servers, topic, group, group_instance_id="runner-1")
        async with c:
            records = await poll_n(c, 3)
            assert [r.offset for r in records] == expected
            for record in records:
                c.done(record)
            await c.commit_done()
