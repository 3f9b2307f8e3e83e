"""2,000 bad messages through a running pipeline, with valid requests between them: every bad
message gets exactly one error event naming the problem (on the tokens topic when its request id
could be read, else on the dead-letter topic with its bytes), the pipeline stays up, and the valid
requests complete. The messages are seeded mutations of valid requests and the classic nasty
inputs: bad UTF-8, deep nesting, huge and wrong-typed fields, NaN and Infinity, 2^70 integers,
duplicate keys, a 2 MB prompt, empty and binary payloads. (The decoder's own property tests, on
hypothesis strategies, are in tests/schemas.)"""

from __future__ import annotations

import base64
import json
import random

import pytest
from pipeline_harness import PipelineProcess, Watcher, new_prefix, publish

pytestmark = pytest.mark.integration

N_BAD = 2000
VALID_EVERY = 200  # a valid request after every this many bad ones


def valid(rid: str) -> dict:
    return {"request_id": rid, "prompt": "Say one word.", "temperature": 0, "max_tokens": 3}


def bad_message(i: int, rng: random.Random) -> tuple[bytes, str | None, str]:
    """(payload, the request id an error event will carry or None for the dead-letter topic,
    a word its error message must contain)."""
    rid = f"fuzz-{i}"
    base = valid(rid)
    kind = i % 14
    if kind == 0:
        return b"\xff\xfe" + json.dumps(base).encode()[2:], None, "UTF-8"
    if kind == 1:
        return json.dumps({**base, f"bogus_{rng.randrange(10**6)}": 1}).encode(), rid, "unknown"
    if kind == 2:
        field, value = rng.choice(
            [
                ("max_tokens", "5"),
                ("temperature", "hot"),
                ("stop", 7),
                ("n", [1]),
                ("ignore_eos", 1),
                ("metadata", "x"),
            ]
        )
        return json.dumps({**base, field: value}).encode(), rid, field
    if kind == 3:
        field, value = rng.choice(
            [
                ("max_tokens", 0),
                ("top_p", 1.5),
                ("temperature", -1),
                ("n", 99),
                ("min_p", 2),
                ("logprobs", 50),
            ]
        )
        return json.dumps({**base, field: value}).encode(), rid, field
    if kind == 4:
        constant = rng.choice(["NaN", "Infinity", "-Infinity"])
        text = json.dumps(base)[:-1] + f', "temperature": {constant}}}'
        return text.encode(), None, "JSON"
    if kind == 5:
        field = rng.choice(["max_tokens", "seed", "priority"])
        return json.dumps({**base, field: 2**70}).encode(), rid, field
    if kind == 6:
        text = json.dumps(base)[:-1] + ', "prompt": "again"}'
        return text.encode(), None, "duplicate"
    if kind == 7:
        depth = rng.choice([2000, 5000, 20000])
        nested = "[" * depth + "]" * depth
        return (json.dumps(base)[:-1] + f', "metadata": {{"x": {nested}}}}}').encode(), None, ""
    if kind == 8:
        return b"", None, "JSON"
    if kind == 9:
        return bytes(rng.randrange(256) for _ in range(rng.randrange(1, 300))), None, ""
    if kind == 10:
        return json.dumps({k: v for k, v in base.items() if k != "prompt"}).encode(), rid, "prompt"
    if kind == 11:
        both = {**base, "messages": [{"role": "user", "content": "hi"}]}
        return json.dumps(both).encode(), rid, "prompt"
    if kind == 12:
        return json.dumps(rng.choice([[1, 2], "a string", 42, None, True])).encode(), None, ""
    # a prompt far past the context (2 MB once, shorter ones the other times)
    size = 2 << 20 if i == 13 else rng.randrange(40_000, 80_000)
    return json.dumps({**base, "prompt": "word " * (size // 5)}).encode(), rid, "prompt"


async def test_two_thousand_bad_messages_each_get_one_error_and_valid_ones_complete(
    bootstrap_servers, tmp_path
):
    rng = random.Random(20261201)
    prefix = new_prefix()
    expected_tokens: dict[str, str] = {}  # request id -> word its error must contain
    expected_dlq: list[tuple[bytes, str]] = []
    valid_ids = []
    messages: list[tuple[bytes | None, bytes]] = []
    for i in range(N_BAD):
        payload, rid, word = bad_message(i, rng)
        if rid is None:
            expected_dlq.append((payload, word))
        else:
            expected_tokens[rid] = word
        messages.append((None, payload))
        if i % VALID_EVERY == VALID_EVERY - 1:
            body = valid(f"valid-{i}")
            valid_ids.append(body["request_id"])
            messages.append((body["request_id"].encode(), json.dumps(body).encode()))
    process = PipelineProcess(bootstrap_servers, None, prefix, tmp_path)
    try:
        process.wait_ready()
        async with Watcher(bootstrap_servers, prefix) as watcher:
            await publish(bootstrap_servers, f"{prefix}.requests", messages)

            def all_answered(streams) -> bool:
                return len(streams.dead_letters) >= len(expected_dlq) and all(
                    streams.finals(rid) for rid in (*expected_tokens, *valid_ids)
                )

            await watcher.wait_for(all_answered, 300, "an answer to every message")
            await watcher.caught_up()
            streams = watcher.streams
        assert process.proc.poll() is None, process.tail()  # still up
    finally:
        code = process.stop()
    assert code == 0, process.tail()

    for rid, word in expected_tokens.items():
        events = streams.events[rid]
        assert len(events) == 1 and events[0]["type"] == "error", (rid, events)
        assert word in events[0]["message"] or word == events[0].get("field"), (rid, events[0])
    assert len(streams.dead_letters) == len(expected_dlq)
    by_raw = {}
    for letter in streams.dead_letters:
        raw = base64.b64decode(letter["raw"]) if letter.get("raw") else b""
        by_raw.setdefault(raw, []).append(letter)
    for payload, word in expected_dlq:
        letters = by_raw.get(payload[: 64 << 10])
        assert letters, payload[:80]
        assert word in letters[0]["message"], (payload[:80], letters[0])
    for rid in valid_ids:
        (final,) = [e for e in streams.events[rid] if e["type"] == "final"]
        assert final["usage"]["completion_tokens"] == 3
