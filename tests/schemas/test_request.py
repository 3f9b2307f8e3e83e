"""GenerateRequest: defaults, valid forms, helpers."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta

import pytest
from pydantic import ValidationError

from sluice.schemas import (
    SAMPLING_FIELDS,
    SCHEMA_VERSION,
    GenerateRequest,
    Message,
    RequestRejected,
    decode_request,
    encode,
    new_request_id,
)


def test_minimal_prompt_request_gets_defaults():
    req = decode_request(b'{"prompt": "Hello"}')
    assert req.schema_version == SCHEMA_VERSION == 1
    assert req.prompt == "Hello" and req.messages is None and not req.is_chat
    assert len(req.request_id) == 32 and int(req.request_id, 16) >= 0
    assert (req.temperature, req.top_p, req.top_k, req.min_p) == (1.0, 1.0, 0, 0.0)
    assert req.skip_special_tokens is True
    assert (req.max_tokens, req.n, req.logprobs, req.seed, req.priority) == (256, 1, None, None, 0)
    assert req.stop == [] and req.stop_token_ids == [] and req.ignore_eos is False
    assert req.session_id is req.tenant is req.reply_topic is req.deadline is req.metadata is None


def test_chat_request_round_trips():
    raw = json.dumps(
        {
            "request_id": "r-1",
            "session_id": "s:1",
            "tenant": "acme",
            "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": ""},
                {"role": "tool", "content": "{}"},
            ],
            "temperature": 0,
            "top_p": 0.9,
            "top_k": 40,
            "min_p": 0.05,
            "repetition_penalty": 1.1,
            "presence_penalty": -2,
            "frequency_penalty": 2,
            "max_tokens": 1_000_000,
            "stop": ["\n\n", "###"],
            "stop_token_ids": [2, 0],
            "ignore_eos": True,
            "n": 16,
            "logprobs": 20,
            "seed": 2**64 - 1,
            "reply_topic": "my.replies-1_a",
            "priority": -5,
            "deadline": 1_900_000_000.5,
            "metadata": {"trace": "x", "nested": {"a": [1, 2.5, None, True]}},
        }
    ).encode()
    req = decode_request(raw)
    assert req.is_chat and req.messages[0] == Message(role="system", content="Be brief.")
    assert req.temperature == 0.0 and isinstance(req.temperature, float)
    again = decode_request(encode(req))
    assert again == req
    assert json.loads(encode(again)) == json.loads(encode(req))


def test_top_k_minus_one_means_off_and_is_accepted():
    assert decode_request(b'{"prompt": "x", "top_k": -1}').top_k == -1


@pytest.mark.parametrize(
    "text, expected",
    [
        ('"2030-01-01T00:00:00Z"', 1893456000.0),
        ('"2030-01-01T00:00:00"', 1893456000.0),  # no zone: UTC
        ('"2030-01-01T02:00:00+02:00"', 1893456000.0),
        ("1893456000", 1893456000.0),
        ("1893456000.25", 1893456000.25),
        ("0", 0.0),  # long past: accepted here, the actors answer deadline_exceeded
    ],
)
def test_deadline_accepts_unix_seconds_and_iso_datetimes(text, expected):
    req = decode_request(f'{{"prompt": "x", "deadline": {text}}}'.encode())
    assert req.deadline == expected and isinstance(req.deadline, float)


def test_deadline_from_python_datetime():
    when = datetime.now(UTC) + timedelta(seconds=30)
    assert GenerateRequest(prompt="x", deadline=when).deadline == pytest.approx(when.timestamp())


def test_generated_request_ids_are_unique():
    ids = {decode_request(b'{"prompt": "x"}').request_id for _ in range(2000)}
    ids |= {GenerateRequest(prompt="x").request_id for _ in range(2000)}
    ids |= {new_request_id() for _ in range(2000)}
    assert len(ids) == 6000


def test_client_request_id_is_kept():
    assert decode_request(b'{"prompt": "x", "request_id": "abc-123"}').request_id == "abc-123"


def test_sampling_kwargs_mirror_the_sampling_fields():
    req = GenerateRequest(prompt="x", temperature=0.5, stop=["a"], seed=7)
    kw = req.sampling_kwargs()
    assert tuple(kw) == SAMPLING_FIELDS
    assert kw["temperature"] == 0.5 and kw["stop"] == ["a"] and kw["seed"] == 7
    kw["stop"].append("b")
    assert req.stop == ["a"]  # a copy


def test_sampling_kwargs_build_the_engines_sampling_params():
    from sluice.engine.sampling_params import SamplingParams

    req = decode_request(
        b'{"prompt": "x", "temperature": 0, "top_k": 5, "stop": ["a"], '
        b'"n": 2, "logprobs": 3, "seed": 1, "skip_special_tokens": false}'
    )
    params = SamplingParams(**req.sampling_kwargs())
    params.validate()
    assert (params.temperature, params.top_k, params.stop, params.n) == (0.0, 5, ["a"], 2)
    assert params.skip_special_tokens is False
    # every engine field has a request field, so nothing the engine offers is unreachable
    assert set(SamplingParams.__dataclass_fields__) == set(SAMPLING_FIELDS)


def test_python_construction_is_validated_too():
    with pytest.raises(ValidationError):
        GenerateRequest(prompt="x", max_tokens=0)
    with pytest.raises(ValidationError):
        GenerateRequest()
    with pytest.raises(ValidationError):
        GenerateRequest(prompt="x", max_token=3)
    with pytest.raises(ValidationError):
        GenerateRequest(prompt="x", schema_version=2)


def test_metadata_at_the_size_limit_is_accepted():
    # {"k":"..."} serialized is 8 bytes of framing
    ok = {"k": "x" * (16 * 1024 - 8)}
    assert GenerateRequest(prompt="x", metadata=ok).metadata == ok
    with pytest.raises(ValidationError):
        GenerateRequest(prompt="x", metadata={"k": "x" * (16 * 1024 - 7)})


def test_keep_kv_names_a_key_and_at_most_an_hour():
    req = decode_request(b'{"prompt": "x", "keep_kv": {"key": "run-1", "seconds": 90}}')
    assert req.keep_kv is not None and (req.keep_kv.key, req.keep_kv.seconds) == ("run-1", 90)
    assert decode_request(b'{"prompt": "x"}').keep_kv is None
    for bad, field in [
        ({"key": "run-1", "seconds": 0}, "keep_kv.seconds"),
        ({"key": "run-1", "seconds": 3601}, "keep_kv.seconds"),
        ({"key": "", "seconds": 5}, "keep_kv.key"),
        ({"seconds": 5}, "keep_kv.key"),
        ({"key": "run-1", "seconds": 5, "pin": True}, "keep_kv.pin"),
    ]:
        with pytest.raises(RequestRejected) as info:
            decode_request(json.dumps({"prompt": "x", "keep_kv": bad}))
        assert info.value.event.field == field, (bad, info.value.event)
