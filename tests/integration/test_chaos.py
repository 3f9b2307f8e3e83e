"""Chaos on a broker and a Redis of the test's own, in both delivery modes: a plain aiokafka client
publishes greedy, seeded and unseeded sampled requests and three multi-turn chat sessions, with
malformed messages between them, all at once; meanwhile `sluice run` is SIGKILLed three times in
the middle of generation, the broker is SIGKILLed and restarted once, and Redis once.

Every valid request gets one final; no (request_id, seq) ever carries two contents; the token
texts in seq order are the final's text; every malformed message gets its error event; each
session's record in Redis holds each of its turns once, in order, every turn built on the answer
of the one before. With exactly-once delivery a read_committed consumer sees every
(request_id, seq) exactly once, with no gaps: nothing of an aborted transaction."""

from __future__ import annotations

import asyncio
import json

import pytest
import redis.asyncio as aioredis
from test_crash_resume import assert_exactly_once, assert_one_consistent_stream

from sluice.connectors.kafka_broker import LocalKafka
from sluice.connectors.redis_server import LocalRedis
from sluice.connectors.sessions import SessionRecord, session_key
from sluice.testing.pipeline_harness import (
    PipelineProcess,
    Streams,
    Watcher,
    committed_everything,
    new_prefix,
    private_stack,
    publish,
    request,
    sigkill,
)

pytestmark = pytest.mark.integration

SUBJECTS = ["the sea", "a robot", "coffee", "the moon", "trains", "cats", "rain", "music"]
QUESTIONS = ["Name a colour.", "Why that one?", "Now name another."]
SESSIONS = ["s-red", "s-green", "s-blue"]
TENANT = "chaos"


def standalone_requests() -> list[dict]:
    """Greedy, seeded and unseeded sampled requests of spread lengths."""
    out = []
    for i in range(12):
        body = {
            "request_id": f"chaos-{i:02d}",
            "prompt": f"Item {i}: some words about {SUBJECTS[i % len(SUBJECTS)]},",
            "max_tokens": 12 + 5 * i,
            "ignore_eos": True,
            "temperature": 0 if i % 3 == 0 else 1.0,
        }
        if i % 3:
            body["top_p"] = 0.95
        if i % 3 == 1:
            body["seed"] = 500 + i
        out.append(body)
    return out


def session_turns(tenant: str) -> list[dict]:
    """Three turns of each session, published together: each waits for the one before."""
    out = []
    for s, session in enumerate(SESSIONS):
        for t, question in enumerate(QUESTIONS):
            out.append(
                {
                    "request_id": f"{session}-t{t}",
                    "session_id": session,
                    "tenant": tenant,
                    "messages": [{"role": "user", "content": question}],
                    "max_tokens": 16,
                    "ignore_eos": True,
                    "temperature": 0 if s == 0 else 0.8,
                    **({"seed": 77} if s == 1 else {}),
                }
            )
    return out


def malformed() -> list[tuple[bytes, str | None]]:
    """(payload, the request id its error event carries, or None for a dead letter)."""
    return [
        (b'{"request_id": "bad-0", "prompt": "x", "max_tokens": "5"}', "bad-0"),
        (b'{"request_id": "bad-1", "prompt": "x", "bogus": 1}', "bad-1"),
        (b'{"request_id": "bad-2"}', "bad-2"),
        (b'{"request_id": "bad-3", "prompt": "x", "top_p": 7}', "bad-3"),
        (b"\xff\xfe not json", None),
        (b"", None),
        (b'{"request_id": "bad-4", "prompt": "x", "prompt": "y"}', None),
        (b"[1, 2, 3]", None),
    ]


@pytest.fixture
def own_stack(tmp_path):
    """A broker and a Redis for this test alone (it kills them), Redis syncing every write."""
    settings = private_stack(tmp_path / "stack")
    kafka, redis = LocalKafka(settings), LocalRedis(settings)
    kafka.start()
    redis.start()
    try:
        yield settings, kafka, redis
    finally:
        kafka.stop()
        redis.stop()


@pytest.mark.parametrize("delivery", ["at-least-once", "exactly-once"])
async def test_chaos_kills_broker_and_redis_restarts_lose_and_change_nothing(
    own_stack, tmp_path, delivery
):
    settings, kafka, redis = own_stack
    bootstrap = settings.bootstrap_servers
    prefix = new_prefix()
    exactly_once = delivery == "exactly-once"
    bodies, bad, messages = workload(TENANT)
    processes: list[PipelineProcess] = []

    def start(name: str) -> PipelineProcess:
        process = PipelineProcess(
            bootstrap, settings.redis_url, prefix, tmp_path, "--delivery", delivery, name=name
        )
        processes.append(process)
        process.wait_ready(timeout=180)
        return process

    faults: list[str] = []
    try:
        current = start("first")
        isolation = "read_committed" if exactly_once else "read_uncommitted"
        async with Watcher(bootstrap, prefix, isolation) as watcher:
            await publish(bootstrap, f"{prefix}.requests", messages)

            async def after_finals(n: int) -> None:
                def enough(s: Streams) -> bool:
                    return sum(1 for rid in bodies if s.finals(rid)) >= n

                await watcher.wait_for(enough, 300, f"{n} finals")

            # (finals to wait for, what to break)
            for n, fault in [(3, "run"), (6, "broker"), (9, "run"), (11, "redis"), (13, "run")]:
                await after_finals(n)
                faults.append(fault)
                if fault == "run":
                    current.kill()
                    current = start(f"after-kill-{faults.count('run')}")
                elif fault == "broker":
                    await sigkill(kafka.pid())
                    await asyncio.to_thread(kafka.start)  # (it runs a loop of its own)
                else:  # down long enough for the pipeline to notice (session turns wait)
                    await sigkill(redis.pid())
                    await asyncio.sleep(2)
                    await asyncio.to_thread(redis.start)
            streams = await every_answer(watcher, bodies, bad)
        # (the last process may first wait for the killed one's partitions: a session timeout)
        assert await committed_everything(bootstrap, f"{prefix}.requests", prefix, timeout=120)
        code = current.stop()
        assert code == 0, current.tail()
        records = await session_records(settings.redis_url, TENANT)
    finally:
        for process in processes:
            process.kill()
    assert_outcome(streams, bodies, bad, records, exactly_once, processes)


def workload(tenant: str) -> tuple[dict[str, dict], list, list[tuple[bytes | None, bytes]]]:
    """(valid requests by id, malformed messages, all of them as records in publish order)."""
    bodies = {b["request_id"]: b for b in [*standalone_requests(), *session_turns(tenant)]}
    bad = malformed()
    messages: list[tuple[bytes | None, bytes]] = [
        request(rid, **{k: v for k, v in b.items() if k != "request_id"})
        for rid, b in bodies.items()
    ]
    for i, (payload, _) in enumerate(bad):  # between the valid ones
        messages.insert(3 * i + 1, (None, payload))
    return bodies, bad, messages


async def every_answer(watcher: Watcher, bodies: dict, bad: list) -> Streams:
    streams = await watcher.wait_finals(
        # (less than a turn's wait for its previous turn: a turn held up by a turn that never
        # ends shows as a timeout)
        set(bodies) | {rid for _, rid in bad if rid},
        timeout=240,
    )
    await watcher.wait_for(
        lambda s: len(s.dead_letters) >= sum(1 for _, rid in bad if rid is None),
        60,
        "the dead letters",
    )
    return streams


def assert_outcome(
    streams: Streams,
    bodies: dict,
    bad: list,
    records: dict[str, SessionRecord],
    exactly_once: bool,
    processes: list[PipelineProcess],
) -> None:
    logs = "\n".join(p.tail(30) for p in processes)
    assert not any("served without it" in p.text() for p in processes), logs

    for rid, body in bodies.items():
        events = streams.events[rid]
        final = assert_one_consistent_stream(events, rid, body["max_tokens"])
        if exactly_once:
            assert_exactly_once(events, rid)
        if "seed" in body:
            assert final["seed"] == body["seed"], rid
    for _, rid in bad:
        if rid is None:
            continue
        errors = [e for e in streams.events[rid] if e["type"] == "error"]
        assert errors and len(errors) == (1 if exactly_once else len(errors)), (rid, errors)
        assert len({json.dumps(e, sort_keys=True) for e in errors}) == 1, (rid, errors)
    letters = len(streams.dead_letters)
    expected_letters = sum(1 for _, rid in bad if rid is None)
    assert letters == expected_letters if exactly_once else letters >= expected_letters, logs

    for session in SESSIONS:
        record = records[session]
        ids = [f"{session}-t{t}" for t in range(len(QUESTIONS))]
        assert record.turn_ids == ids, (session, record.turn_ids)
        assert record.pending is None, session
        finals = [next(e for e in streams.events[rid] if e["type"] == "final") for rid in ids]
        expected = []
        for question, final in zip(QUESTIONS, finals, strict=True):
            expected += [
                {"role": "user", "content": question},
                {"role": "assistant", "content": final["text"]},
            ]
        assert record.messages == expected, session
        for before, after in zip(finals, finals[1:], strict=False):
            # Each turn's prompt is the whole conversation before it: built on its answer.
            seen = before["usage"]["prompt_tokens"] + before["usage"]["completion_tokens"]
            assert after["usage"]["prompt_tokens"] > seen, (session, before["usage"], after)


async def session_records(url: str, tenant: str) -> dict[str, SessionRecord]:
    client = aioredis.Redis.from_url(url)
    try:
        out = {}
        for session in SESSIONS:
            raw = await client.get(session_key(tenant, session))
            assert raw is not None, f"no record of session {session}"
            out[session] = SessionRecord.model_validate_json(raw)
        return out
    finally:
        await client.aclose()
