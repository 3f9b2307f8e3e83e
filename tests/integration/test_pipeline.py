"""The product end to end on the real broker and Redis: `sluice run` with all actors in one process,
driven by a plain aiokafka client."""

from __future__ import annotations

import json
import time

import pytest
import redis.asyncio as aioredis

from sluice.engine import EngineConfig, LLMEngine, SamplingParams
from sluice.testing.pipeline_harness import (
    PipelineProcess,
    collect,
    committed_everything,
    fifty_requests,
    new_prefix,
    publish,
    request,
    settled_session,
)

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    return LLMEngine(config=EngineConfig(kv_cache_bytes=256 << 20))


def in_process_text(engine: LLMEngine, body: dict) -> str:
    params = SamplingParams(temperature=0, max_tokens=body["max_tokens"])
    if "messages" in body:
        return engine.generate(messages=[body["messages"]], params=params)[0].text
    return engine.generate([body["prompt"]], params)[0].text


@pytest.fixture
def prefix() -> str:
    return new_prefix()


async def test_fifty_requests_stream_complete_and_match_the_engine(
    bootstrap_servers, redis_url, prefix, tmp_path, engine
):
    bodies = fifty_requests()
    pipeline = PipelineProcess(bootstrap_servers, redis_url, prefix, tmp_path)
    try:
        pipeline.wait_ready()
        await publish(
            bootstrap_servers,
            f"{prefix}.requests",
            [
                request(b["request_id"], **{k: v for k, v in b.items() if k != "request_id"})
                for b in bodies
            ],
        )
        streams = await collect(bootstrap_servers, prefix, {b["request_id"] for b in bodies})
        assert await committed_everything(bootstrap_servers, f"{prefix}.requests", prefix)
    finally:
        code = pipeline.stop()
    assert code == 0, pipeline.tail()

    for body in bodies:
        rid = body["request_id"]
        events = streams.events[rid]
        finals = [e for e in events if e["type"] == "final"]
        assert len(finals) == 1, (rid, events)
        tokens = [e for e in events if e["type"] == "token"]
        assert [e["seq"] for e in tokens] == list(range(len(tokens))), rid
        assert finals[0]["seq"] == len(tokens)
        text = "".join(e["text"] for e in tokens)
        assert text == finals[0]["text"]
        assert text == in_process_text(engine, body), rid
        assert finals[0]["usage"]["completion_tokens"] == sum(len(e["token_ids"]) for e in tokens)
        # what produced it: the same model, software and settings as the engine here
        assert engine.provenance.differences(finals[0]["provenance"]) == {}, rid


async def test_bad_input_gets_named_errors_and_valid_requests_around_it_complete(
    bootstrap_servers, prefix, tmp_path
):
    good = {"temperature": 0, "max_tokens": 4}
    messages = [
        request("ok-1", prompt="Hello", **good),
        (None, b"\xff\xfe not json at all"),
        request("missing-prompt", temperature=0),
        request("wrong-type", prompt="hi", max_tokens="ten"),
        request("out-of-range", prompt="hi", top_p=1.5),
        request("too-long", prompt="word " * 9000, max_tokens=4),
        request("old-version", prompt="hi", schema_version=99),
        (None, json.dumps({"prompt": "no id", "temperature": -1}).encode()),
        request("ok-2", prompt="Goodbye", **good),
    ]
    pipeline = PipelineProcess(bootstrap_servers, None, prefix, tmp_path)
    try:
        pipeline.wait_ready()
        await publish(bootstrap_servers, f"{prefix}.requests", messages)
        expected = {
            "ok-1",
            "ok-2",
            "missing-prompt",
            "wrong-type",
            "out-of-range",
            "too-long",
            "old-version",
        }
        streams = await collect(bootstrap_servers, prefix, expected, dlq_expected=1)
        assert await committed_everything(bootstrap_servers, f"{prefix}.requests", prefix)
    finally:
        pipeline.stop()

    def error(rid: str) -> dict:
        (event,) = streams.finals(rid)
        assert event["type"] == "error", event
        return event

    assert (
        error("missing-prompt")["code"] == "invalid_request"
        and "prompt" in error("missing-prompt")["message"]
    )
    assert error("wrong-type")["field"] == "max_tokens"
    assert error("out-of-range")["field"] == "top_p"
    assert (
        error("too-long")["code"] == "prompt_too_long" and "context" in error("too-long")["message"]
    )
    assert error("old-version")["code"] == "unsupported_schema_version"
    for rid in ("ok-1", "ok-2"):
        (final,) = streams.finals(rid)
        assert final["type"] == "final" and final["usage"]["completion_tokens"] == 4
    # Undecodable bytes and an invalid request without an id land on the dead-letter topic with
    # their raw bytes.
    codes = sorted(e["code"] for e in streams.dead_letters)
    assert codes[0] == "invalid_json" or "invalid_json" in codes
    assert all(e.get("raw") for e in streams.dead_letters)


async def test_a_deadline_passing_while_generating_ends_the_stream_with_what_was_sent(
    bootstrap_servers, prefix, tmp_path
):
    pipeline = PipelineProcess(bootstrap_servers, None, prefix, tmp_path)
    try:
        pipeline.wait_ready()
        now = time.time()
        await publish(
            bootstrap_servers,
            f"{prefix}.requests",
            [
                # ~2 minutes of tokens on this CPU without its deadline
                request(
                    "long",
                    prompt="Count to ten thousand:",
                    temperature=0,
                    max_tokens=4000,
                    ignore_eos=True,
                    deadline=now + 4,
                ),
                request("late", prompt="hi", max_tokens=4, deadline=now - 1),
                request("no-deadline", prompt="Hello", temperature=0, max_tokens=4),
            ],
        )
        streams = await collect(
            bootstrap_servers, prefix, {"long", "late", "no-deadline"}, timeout=90
        )
        assert await committed_everything(bootstrap_servers, f"{prefix}.requests", prefix)
    finally:
        pipeline.stop()

    (final,) = streams.finals("long")
    assert final["type"] == "final", final
    assert final["finish_reason"] == "abort" and final["stop_reason"] == "deadline"
    tokens = [e for e in streams.events["long"] if e["type"] == "token"]
    assert 0 < final["usage"]["completion_tokens"] < 4000
    assert final["usage"]["completion_tokens"] == sum(len(e["token_ids"]) for e in tokens)
    assert [e["seq"] for e in tokens] == list(range(len(tokens))) and final["seq"] == len(tokens)
    (late,) = streams.finals("late")
    assert late["type"] == "error" and late["code"] == "deadline_exceeded"
    (other,) = streams.finals("no-deadline")
    assert other["finish_reason"] == "length" and other["usage"]["completion_tokens"] == 4


async def test_second_turn_of_a_session_reuses_the_first_turns_kv_cache(
    bootstrap_servers, redis_url, prefix, tmp_path
):
    session = f"s-{prefix}"
    pipeline = PipelineProcess(bootstrap_servers, redis_url, prefix, tmp_path)
    try:
        pipeline.wait_ready()
        turn = {"temperature": 0, "max_tokens": 24, "session_id": session, "tenant": "acme"}
        await publish(
            bootstrap_servers,
            f"{prefix}.requests",
            [
                request(
                    "turn-1", messages=[{"role": "user", "content": "Name three rivers."}], **turn
                )
            ],
        )
        first = (await collect(bootstrap_servers, prefix, {"turn-1"})).finals("turn-1")[0]
        await publish(
            bootstrap_servers,
            f"{prefix}.requests",
            [
                request(
                    "turn-2", messages=[{"role": "user", "content": "Which is longest?"}], **turn
                )
            ],
        )
        second = (await collect(bootstrap_servers, prefix, {"turn-2"})).finals("turn-2")[0]
    finally:
        pipeline.stop()

    assert first["type"] == second["type"] == "final"
    conversation = first["usage"]["prompt_tokens"] + first["usage"]["completion_tokens"]
    assert second["usage"]["prompt_tokens"] > conversation  # turn 2 carries turn 1
    assert second["usage"]["cached_tokens"] >= conversation // 16 * 16
    client = aioredis.Redis.from_url(redis_url)
    try:
        keys = [k async for k in client.scan_iter(match=f"*{session}*")]
        assert len(keys) == 1
        assert 0 < await client.ttl(keys[0]) <= 3600
        record = await settled_session(redis_url, "acme", session, turns=2)
        assert [m["role"] for m in record["messages"]] == ["user", "assistant", "user", "assistant"]
    finally:
        await client.aclose()


async def test_turns_published_together_wait_for_each_other_and_a_replay_is_held_once(
    bootstrap_servers, redis_url, prefix, tmp_path
):
    """Three turns of one chat published back to back: each is built on the answer before it
    (it waits for it), and the first sent again afterwards (a client retry under the same id)
    replaces its own entry: the session never holds a turn twice."""
    session = f"s-{prefix}"
    turn = {"temperature": 0, "max_tokens": 12, "session_id": session, "tenant": "acme"}
    questions = ["Name a river.", "How long is it?", "Which sea does it reach?"]
    pipeline = PipelineProcess(bootstrap_servers, redis_url, prefix, tmp_path)
    try:
        pipeline.wait_ready()
        turns = [
            request(f"t{i}", messages=[{"role": "user", "content": q}], **turn)
            for i, q in enumerate(questions)
        ]
        await publish(bootstrap_servers, f"{prefix}.requests", turns)
        streams = await collect(bootstrap_servers, prefix, {"t0", "t1", "t2"})
        client = aioredis.Redis.from_url(redis_url)
        try:
            (key,) = [k async for k in client.scan_iter(match=f"*{session}*")]
            after_three = await settled_session(redis_url, "acme", session, turns=3)
            await publish(bootstrap_servers, f"{prefix}.requests", [turns[0]])  # again
            after_replay = await settled_session(redis_url, "acme", session, turns=1)
        finally:
            await client.aclose()
    finally:
        pipeline.stop()

    finals = [streams.finals(f"t{i}")[0] for i in range(3)]
    assert all(f["type"] == "final" for f in finals), finals
    for before, after in zip(finals, finals[1:]):
        conversation = before["usage"]["prompt_tokens"] + before["usage"]["completion_tokens"]
        assert after["usage"]["prompt_tokens"] > conversation  # built on the answer before it
    assert after_three["turn_ids"] == ["t0", "t1", "t2"] and after_three["pending"] is None
    roles = [m["role"] for m in after_three["messages"]]
    assert roles == ["user", "assistant"] * 3
    assert [m["content"] for m in after_three["messages"][1::2]] == [f["text"] for f in finals]
    # The replayed first turn holds its place once, with the same answer (greedy).
    assert after_replay["turn_ids"] == ["t0"]
    assert after_replay["messages"] == after_three["messages"][:2]
