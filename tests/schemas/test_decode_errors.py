"""decode_request: every class of bad input becomes the right error event."""

from __future__ import annotations

import base64
import json

import pytest

from sluice.schemas import ErrorCode, ErrorEvent, RequestRejected, decode_request, encode


def reject(raw: bytes | str) -> ErrorEvent:
    with pytest.raises(RequestRejected) as info:
        decode_request(raw)
    event = info.value.event
    assert isinstance(event, ErrorEvent) and event.type == "error"
    assert info.value.code == event.code
    # the ready-made event is itself valid on the wire
    assert ErrorEvent.model_validate_json(encode(event)) == event
    return event


def obj(**fields) -> bytes:
    return json.dumps({"request_id": "rid-1", **fields}).encode()


@pytest.mark.parametrize(
    "raw, why",
    [
        (b"\xff\xfe{}", "not UTF-8"),
        (b'{"prompt": "caf\xe9"}', "not UTF-8"),
        (b"", "not JSON"),
        (b"hello", "not JSON"),
        (b'{"prompt": "x",}', "not JSON"),
        (b'{"prompt": "x"', "not JSON"),
        (b'{"prompt": "x", "temperature": NaN}', "NaN is not valid JSON"),
        (b'{"prompt": "x", "temperature": -Infinity}', "-Infinity is not valid JSON"),
        (b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
        (b'{"prompt": "a", "prompt": "b"}', "duplicate key 'prompt'"),
        (b'{"prompt": "x", "metadata": {"k": 1, "k": 2}}', "duplicate key 'k'"),
    ],
)
def test_undecodable_bytes_are_invalid_json(raw, why):
    event = reject(raw)
    assert event.code == ErrorCode.INVALID_JSON == "invalid_json"
    assert why in event.message
    assert event.request_id is None and event.seq is None
    # no request id: destined for the dead-letter topic, so it carries the raw bytes
    assert event.raw_bytes() == raw[: 64 * 1024] and event.raw_size == len(raw)


@pytest.mark.parametrize(
    "raw, kind",
    [
        (b"[1, 2]", "an array"),
        (b'"prompt"', "a string"),
        (b"42", "a number"),
        (b"null", "null"),
        (b"true", "a boolean"),
    ],
)
def test_json_that_is_not_an_object_is_invalid_request(raw, kind):
    event = reject(raw)
    assert event.code == "invalid_request"
    assert event.message == f"a request must be a JSON object, not {kind}"
    assert event.raw_bytes() == raw


@pytest.mark.parametrize(
    "fields, field, message",
    [
        # missing / both
        ({}, "prompt", "prompt: field required"),
        ({"temperature": 0.5}, "prompt", "prompt: field required"),
        (
            {"prompt": "x", "messages": [{"role": "user", "content": "y"}]},
            "messages",
            "give either prompt or messages, not both",
        ),
        # wrong types
        ({"prompt": 5}, "prompt", "prompt: must be a string (got 5)"),
        (
            {"prompt": "x", "max_tokens": "5"},
            "max_tokens",
            'max_tokens: must be an integer (got "5")',
        ),
        (
            {"prompt": "x", "max_tokens": 5.5},
            "max_tokens",
            "max_tokens: must be an integer (got 5.5)",
        ),
        ({"prompt": "x", "temperature": "hot"}, "temperature", "temperature: must be a number"),
        ({"prompt": "x", "temperature": True}, "temperature", "temperature: must be a number"),
        (
            {"prompt": "x", "ignore_eos": 1},
            "ignore_eos",
            "ignore_eos: must be true or false (got 1)",
        ),
        ({"prompt": "x", "stop": "###"}, "stop", "stop: must be an array"),
        ({"prompt": "x", "stop": [1]}, "stop.0", "stop.0: must be a string (got 1)"),
        ({"messages": "hi"}, "messages", "messages: must be an array"),
        ({"messages": ["hi"]}, "messages.0", "messages.0: must be an object"),
        (
            {"messages": [{"role": "user"}]},
            "messages.0.content",
            "messages.0.content: field required",
        ),
        (
            {"messages": [{"role": "bot", "content": "x"}]},
            "messages.0.role",
            "messages.0.role: must be one of 'system', 'user', 'assistant' or 'tool' (got \"bot\")",
        ),
        ({"prompt": "x", "metadata": [1]}, "metadata", "metadata: must be an object"),
        ({"prompt": "x", "session_id": 7}, "session_id", "session_id: must be a string (got 7)"),
        # empty / invalid strings
        ({"prompt": ""}, "prompt", 'prompt: must not be empty (got "")'),
        ({"messages": []}, "messages", "messages: must not be empty"),
        ({"prompt": "x", "stop": [""]}, "stop.0", "stop.0: must not be empty"),
        (
            {"prompt": "x", "session_id": "a b"},
            "session_id",
            "session_id: must be printable ASCII without spaces",
        ),
        ({"prompt": "x", "tenant": "t" * 65}, "tenant", "tenant: must be at most 64 characters"),
        (
            {"prompt": "x", "reply_topic": "bad topic"},
            "reply_topic",
            "reply_topic: must be a Kafka topic name",
        ),
        ({"prompt": "x", "reply_topic": ".."}, "reply_topic", "reply_topic: must be a Kafka"),
        (
            {"prompt": "x", "reply_topic": "t" * 250},
            "reply_topic",
            "reply_topic: must be 1 to 249 characters",
        ),
        (
            {"prompt": "x", "deadline": "tomorrow"},
            "deadline",
            "deadline: must be unix seconds or an ISO 8601 datetime",
        ),
        ({"prompt": "x", "deadline": -1}, "deadline", "deadline: must be a finite time >= 0"),
        # out of range
        ({"prompt": "x", "max_tokens": 0}, "max_tokens", "max_tokens: must be >= 1 (got 0)"),
        (
            {"prompt": "x", "max_tokens": 1_000_001},
            "max_tokens",
            "max_tokens: must be <= 1000000 (got 1000001)",
        ),
        (
            {"prompt": "x", "temperature": -0.1},
            "temperature",
            "temperature: must be >= 0.0 (got -0.1)",
        ),
        ({"prompt": "x", "top_p": 0}, "top_p", "top_p: must be > 0.0 (got 0)"),
        ({"prompt": "x", "top_p": 1.5}, "top_p", "top_p: must be <= 1.0 (got 1.5)"),
        ({"prompt": "x", "top_k": -2}, "top_k", "top_k: must be >= -1 (got -2)"),
        ({"prompt": "x", "min_p": 2}, "min_p", "min_p: must be <= 1.0 (got 2)"),
        (
            {"prompt": "x", "repetition_penalty": 0},
            "repetition_penalty",
            "repetition_penalty: must be > 0.0 (got 0)",
        ),
        (
            {"prompt": "x", "presence_penalty": 2.5},
            "presence_penalty",
            "presence_penalty: must be <= 2.0 (got 2.5)",
        ),
        (
            {"prompt": "x", "frequency_penalty": -3},
            "frequency_penalty",
            "frequency_penalty: must be >= -2.0 (got -3)",
        ),
        ({"prompt": "x", "n": 0}, "n", "n: must be >= 1 (got 0)"),
        ({"prompt": "x", "n": 17}, "n", "n: must be <= 16 (got 17)"),
        ({"prompt": "x", "logprobs": 21}, "logprobs", "logprobs: must be <= 20 (got 21)"),
        ({"prompt": "x", "seed": -1}, "seed", "seed: must be >= 0 (got -1)"),
        ({"prompt": "x", "priority": 2**31}, "priority", "priority: must be <= 2147483647"),
        ({"prompt": "x", "stop": ["s"] * 17}, "stop", "stop: must have at most 16 items"),
        (
            {"prompt": "x", "stop_token_ids": [-1]},
            "stop_token_ids.0",
            "stop_token_ids.0: must be >= 0 (got -1)",
        ),
        # unknown fields
        (
            {"prompt": "x", "max_token": 3},
            "max_token",
            "max_token: unknown field (not in schema version 1); did you mean 'max_tokens'?",
        ),
        ({"prompt": "x", "colour": "red"}, "colour", "colour: unknown field"),
        (
            {"messages": [{"role": "user", "content": "x", "nmae": "bob"}]},
            "messages.0.nmae",
            "messages.0.nmae: unknown field",
        ),
        # oversized metadata
        (
            {"prompt": "x", "metadata": {"blob": "x" * 20_000}},
            "metadata",
            "metadata: is 20011 bytes serialized; at most 16384 allowed",
        ),
        # wrong type for the version itself
        (
            {"prompt": "x", "schema_version": "1"},
            "schema_version",
            'schema_version: must be an integer (got "1")',
        ),
    ],
)
def test_invalid_requests_name_the_field_and_the_reason(fields, field, message):
    event = reject(obj(**fields))
    assert event.code == "invalid_request"
    assert event.field == field
    assert message in event.message
    assert event.request_id == "rid-1"  # recovered although the request is invalid
    assert event.raw is None  # has a reply stream: no raw copy needed


@pytest.mark.parametrize(
    "raw, field",
    [
        (b'{"request_id": "rid-1", "prompt": "x", "temperature": 1e999}', "temperature"),
        (b'{"request_id": "rid-1", "prompt": "x", "priority": 1e999}', "priority"),
    ],
)
def test_numbers_too_large_for_a_float_are_not_finite(raw, field):
    event = reject(raw)
    assert event.code == "invalid_request" and event.field == field
    assert f"{field}: must be " in event.message and event.request_id == "rid-1"


def test_non_finite_numbers_in_metadata_are_rejected():
    event = reject(b'{"request_id": "rid-1", "prompt": "x", "metadata": {"v": [1e999]}}')
    assert (event.code, event.field) == ("invalid_request", "metadata")
    assert event.message == "metadata: must contain only finite numbers and valid Unicode"


@pytest.mark.parametrize("version", [0, 2, 99, -1])
def test_wrong_schema_version_is_its_own_code(version):
    # checked before anything else, so a future request is not reported as "unknown fields"
    event = reject(obj(schema_version=version, prompt="x", some_v2_field=True))
    assert event.code == ErrorCode.UNSUPPORTED_SCHEMA_VERSION
    assert event.field == "schema_version"
    assert event.message == (f"schema_version: unsupported version {version}; this server speaks 1")
    assert event.request_id == "rid-1"


def test_request_id_session_and_reply_topic_are_recovered_from_invalid_requests():
    raw = json.dumps(
        {"request_id": "abc", "session_id": "s1", "reply_topic": "mine", "max_tokens": -1}
    ).encode()
    with pytest.raises(RequestRejected) as info:
        decode_request(raw)
    assert info.value.event.request_id == "abc"
    assert info.value.event.session_id == "s1"
    assert info.value.reply_topic == "mine"
    # field errors are reported first; "prompt or messages" is checked once the fields are valid
    assert info.value.event.field == "max_tokens"
    assert "max_tokens: must be >= 1 (got -1)" in info.value.event.message


def test_invalid_request_id_is_not_recovered_and_raw_is_kept():
    raw = json.dumps({"request_id": "has space", "prompt": "x"}).encode()
    event = reject(raw)
    assert event.request_id is None and event.field == "request_id"
    assert base64.b64decode(event.raw) == raw


def test_several_errors_are_listed_in_one_message():
    event = reject(
        obj(prompt="x", n=0, top_p=2, max_tokens=0, min_p=-1, top_k=-9, seed=-1, logprobs=99)
    )
    assert event.field == "top_p"  # first in schema order
    assert event.message.count(";") == 5 and event.message.endswith("and 2 more")


@pytest.mark.parametrize(
    "raw, field",
    [
        (rb'{"prompt": "\ud800x"}', "prompt"),
        (rb'{"prompt": "x", "stop": ["\udc00"]}', "stop.0"),
        (rb'{"prompt": "x", "metadata": {"a": "\udc00"}}', "metadata"),
        (rb'{"prompt": "x", "metadata": {"\udc00": 1}}', "metadata"),
        (rb'{"prompt": "x", "\udc00": 1}', None),
    ],
)
def test_lone_surrogate_escapes_are_rejected_and_the_error_still_encodes(raw, field):
    event = reject(raw)  # reject() also checks the event encodes to valid JSON
    assert event.code == "invalid_request" and event.field == field
    assert "Unicode" in event.message
    encode(event).decode("utf-8")


def test_raw_copy_is_capped_for_the_dead_letter_topic():
    raw = b"\x00" * 200_000
    event = reject(raw)
    assert event.raw_size == 200_000 and len(event.raw_bytes()) == 64 * 1024


def test_str_and_bytearray_inputs_are_accepted():
    assert decode_request('{"prompt": "x"}').prompt == "x"
    assert decode_request(bytearray(b'{"prompt": "x"}')).prompt == "x"
    assert decode_request(memoryview(b'{"prompt": "\xc3\xa9"}')).prompt == "é"
