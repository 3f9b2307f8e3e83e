"""Bad request messages for the fuzz test and the chaos benchmark: seeded mutations of a valid
request and the classic nasty inputs (bad UTF-8, deep nesting, huge and wrong-typed fields, NaN
and Infinity, 2^70 integers, duplicate keys, a 2 MB prompt, empty and binary payloads), each with
where its error event must go and a word its message must contain."""

from __future__ import annotations

import json
import random


def valid(rid: str) -> dict:
    """A valid request: what the mutations start from, and what goes between the bad ones."""
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
