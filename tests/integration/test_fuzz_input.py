"""2,000 bad messages through a running pipeline, with valid requests between them: every bad
message gets exactly one error event naming the problem (on the tokens topic when its request id
could be read, else on the dead-letter topic with its bytes), the pipeline stays up, and the valid
requests complete. The messages (sluice.testing.bad_messages) are seeded mutations of valid
requests and the classic nasty inputs: bad UTF-8, deep nesting, huge and wrong-typed fields, NaN
and Infinity, 2^70 integers, duplicate keys, a 2 MB prompt, empty and binary payloads. (The
decoder's own property tests, on hypothesis strategies, are in tests/schemas.)"""

from __future__ import annotations

import base64
import json
import random

import pytest

from sluice.testing.bad_messages import bad_message, valid
from sluice.testing.pipeline_harness import PipelineProcess, Watcher, new_prefix, publish

pytestmark = pytest.mark.integration

N_BAD = 2000
VALID_EVERY = 200  # a valid request after every this many bad ones


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
