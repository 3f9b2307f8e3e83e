"""The harness service keeps an ended run for a while (a repeat of its request gets its final
again, and runs nothing), then forgets it: its state is deleted from the state topic, and a
request with its id is a new run. A plain Kafka client stands in for the pipeline (it answers the
run's model turn with a final event): what is tried here is the service's memory, on the real
broker."""

from __future__ import annotations

import asyncio
import json
import time

import pytest
from aiokafka import AIOKafkaConsumer, TopicPartition

from sluice.connectors.topics import partitions_of
from sluice.harness.service import HarnessService
from sluice.testing.pipeline_harness import new_prefix, publish

pytestmark = pytest.mark.integration

RUN = {
    "run_id": "r-1",
    "messages": [{"role": "user", "content": "What is 2 + 3?"}],
    "tools": [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}],
}


def answer(request_id: str) -> bytes:
    final = {
        "type": "final",
        "request_id": request_id,
        "seq": 1,
        "finish_reason": "stop",
        "usage": {"prompt_tokens": 20, "completion_tokens": 1},
        "timings": {"queue_s": 0, "total_s": 0.1},
        "model": "m",
        "text": "5",
    }
    return json.dumps(final).encode()


async def last_values(bootstrap: str, topic: str) -> dict[str, bytes | None]:
    """Each key's last value on a topic, read to its end (None: a tombstone)."""
    tps = [TopicPartition(topic, p) for p in await partitions_of(bootstrap, topic)]
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False)
    await consumer.start()
    try:
        consumer.assign(tps)
        await consumer.seek_to_beginning(*tps)
        ends = await consumer.end_offsets(tps)
        values: dict[str, bytes | None] = {}
        left = set(tps)
        while left:
            for records in (await consumer.getmany(timeout_ms=500)).values():
                values |= {r.key.decode(): r.value for r in records}
            left = {tp for tp in left if await consumer.position(tp) < ends[tp]}
        return values
    finally:
        await consumer.stop()


async def test_an_ended_run_is_kept_for_repeats_then_forgotten(bootstrap_servers):
    prefix = new_prefix()
    service = HarnessService(bootstrap_servers, prefix, keep_ended_s=2.0)
    await service.start()
    serving = asyncio.create_task(service.run())
    reader = AIOKafkaConsumer(
        f"{prefix}.requests",
        f"{prefix}.harness-events",
        bootstrap_servers=bootstrap_servers,
        auto_offset_reset="earliest",
    )
    await reader.start()
    seen: list[tuple[str, dict]] = []

    async def until(holds, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while not holds():
            assert time.monotonic() < deadline, seen
            for tp, records in (await reader.getmany(timeout_ms=200)).items():
                seen.extend((tp.topic.rpartition(".")[2], json.loads(r.value)) for r in records)

    def turns() -> int:
        return sum(t == "requests" for t, _ in seen)

    def finals() -> int:
        return sum(t == "harness-events" and e["type"] == "harness_final" for t, e in seen)

    asked = [(b"r-1", json.dumps(RUN).encode())]
    try:
        await publish(bootstrap_servers, f"{prefix}.harness", asked)
        await until(lambda: turns() == 1)
        await publish(
            bootstrap_servers, f"{prefix}.replies.harness", [(b"r-1.m0", answer("r-1.m0"))]
        )
        await until(lambda: finals() == 1)
        # asked again while kept: the final again, nothing run
        await publish(bootstrap_servers, f"{prefix}.harness", asked)
        await until(lambda: finals() == 2)
        assert turns() == 1 and "r-1" in service.runs

        # forgotten: gone from memory and from the state topic (a service started later has it
        # not), and the same request is a new run
        await until(lambda: "r-1" not in service.runs, timeout=10)
        kept = await last_values(bootstrap_servers, f"{prefix}.harness-state")
        assert "r-1" in kept and kept["r-1"] is None  # (a tombstone: compaction drops the key)
        await publish(bootstrap_servers, f"{prefix}.harness", asked)
        await until(lambda: turns() == 2)
    finally:
        serving.cancel()
        await asyncio.gather(serving, return_exceptions=True)
        await reader.stop()
        await service.stop()
    first, second = [e for t, e in seen if t == "harness-events" and e["type"] == "harness_final"]
    assert first == second and first["answer"] == "5" and first["stop_reason"] == "answer"
