"""Reply topics on the real broker: a request may name a topic matching the pattern
(`PREFIX.replies.*`) that exists; an internal topic, a topic outside the pattern and a missing one
get an error event at once on the default tokens topic, and the ordinary requests published right
after them on the same partition finish without waiting (producing to a missing topic used to
block on its metadata for half a minute per event). With --create-reply-topics a missing allowed
topic is created and used."""

from __future__ import annotations

import asyncio
import json
import time

import pytest
from aiokafka import AIOKafkaConsumer

from sluice.connectors.topics import ensure_topics
from sluice.testing.pipeline_harness import PipelineProcess, new_prefix, publish

pytestmark = pytest.mark.integration

KEY = b"one-partition"  # every request on the same partition, behind the bad ones


def body(request_id: str, **fields) -> tuple[bytes, bytes]:
    fields = {"prompt": "Say one word.", "temperature": 0, "max_tokens": 3, **fields}
    return KEY, json.dumps({"request_id": request_id, **fields}).encode()


async def read_until(bootstrap: str, topics: list[str], done, timeout: float) -> list[tuple]:
    """(topic, event) pairs from `topics` until done(pairs) holds."""
    consumer = AIOKafkaConsumer(
        *topics, bootstrap_servers=bootstrap, auto_offset_reset="earliest", metadata_max_age_ms=1000
    )
    await consumer.start()
    pairs: list[tuple] = []
    try:
        deadline = time.monotonic() + timeout
        while not done(pairs):
            assert time.monotonic() < deadline, pairs
            batch = await consumer.getmany(timeout_ms=500)
            pairs += [(tp.topic, json.loads(r.value)) for tp, rs in batch.items() for r in rs]
    finally:
        await consumer.stop()
    return pairs


def terminal(pairs: list[tuple], rid: str) -> tuple[str, dict] | None:
    for topic, event in pairs:
        if event.get("request_id") == rid and event["type"] in ("final", "error"):
            return topic, event
    return None


async def test_reply_topics_allowed_refused_and_missing(bootstrap_servers, tmp_path):
    prefix = new_prefix()
    allowed = f"{prefix}.replies.ok"
    await ensure_topics(bootstrap_servers, {allowed: 1})
    process = PipelineProcess(bootstrap_servers, None, prefix, tmp_path)
    try:
        process.wait_ready()
        started = time.monotonic()
        await publish(
            bootstrap_servers,
            f"{prefix}.requests",
            [
                body("missing", reply_topic=f"{prefix}.replies.nope"),
                body("internal", reply_topic=f"{prefix}.internal.work"),
                body("requests", reply_topic=f"{prefix}.requests"),
                body("elsewhere", reply_topic="someone.elses.topic"),
                body("allowed", reply_topic=allowed),
                body("plain-1"),
                body("plain-2"),
            ],
        )
        rids = ["missing", "internal", "requests", "elsewhere", "allowed", "plain-1", "plain-2"]
        pairs = await read_until(
            bootstrap_servers,
            [f"{prefix}.tokens", allowed],
            lambda ps: all(terminal(ps, r) for r in rids),
            timeout=120,
        )
        elapsed = time.monotonic() - started
    finally:
        code = process.stop()
    assert code == 0, process.tail()

    for rid in ("missing", "internal", "requests", "elsewhere"):
        topic, event = terminal(pairs, rid)
        assert topic == f"{prefix}.tokens" and event["type"] == "error", (rid, event)
        assert event["code"] == "invalid_request" and event["field"] == "reply_topic", event
    assert "does not exist" in terminal(pairs, "missing")[1]["message"]
    assert "not an allowed reply topic" in terminal(pairs, "internal")[1]["message"]
    assert f"{prefix}.replies.*" in terminal(pairs, "elsewhere")[1]["message"]
    topic, event = terminal(pairs, "allowed")
    assert (topic, event["type"]) == (allowed, "final")
    assert not [e for t, e in pairs if e.get("request_id") == "allowed" and t != allowed]
    for rid in ("plain-1", "plain-2"):
        assert terminal(pairs, rid) == (f"{prefix}.tokens", terminal(pairs, rid)[1])
        assert terminal(pairs, rid)[1]["type"] == "final"
    # No stall behind the bad ones: producing to a missing topic used to wait 30 s per event.
    assert elapsed < 25, elapsed


async def test_a_missing_allowed_topic_is_created_when_configured(bootstrap_servers, tmp_path):
    prefix = new_prefix()
    created = f"{prefix}.replies.new"
    process = PipelineProcess(bootstrap_servers, None, prefix, tmp_path, "--create-reply-topics")
    try:
        process.wait_ready()
        await publish(bootstrap_servers, f"{prefix}.requests", [body("new", reply_topic=created)])
        deadline = time.monotonic() + 60
        while "created reply topic" not in process.text():
            assert time.monotonic() < deadline, process.tail()
            await asyncio.sleep(0.2)
        pairs = await read_until(
            bootstrap_servers, [created], lambda ps: terminal(ps, "new"), timeout=60
        )
    finally:
        code = process.stop()
    assert code == 0, process.tail()
    assert terminal(pairs, "new")[1]["type"] == "final"
