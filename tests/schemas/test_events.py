"""Output events: round trips, the discriminated union, lenient reading."""

from __future__ import annotations

import json

import pytest
from pydantic import TypeAdapter, ValidationError

from sluice.schemas import (
    Choice,
    ErrorCode,
    ErrorEvent,
    FinalEvent,
    GenerateRequest,
    OutputEvent,
    Timings,
    TokenEvent,
    TokenLogprob,
    TopLogprob,
    UnknownEventType,
    Usage,
    decode_event,
    encode,
)

FINAL = FinalEvent(
    request_id="r1",
    seq=3,
    finish_reason="length",
    usage=Usage(prompt_tokens=10, cached_tokens=8, completion_tokens=3),
    timings=Timings(queue_s=0.001, ttft_s=0.02, tpot_s=0.005, total_s=0.03),
    model="smollm2",
    text="abc",
    metadata={"k": [1, None]},
)


def test_token_event_wire_form():
    ev = TokenEvent(request_id="r1", seq=0, token_ids=[5, 6], text="Hi")
    assert json.loads(encode(ev)) == {
        "schema_version": 1,
        "type": "token",
        "request_id": "r1",
        "seq": 0,
        "index": 0,
        "token_ids": [5, 6],
        "text": "Hi",
    }
    assert decode_event(encode(ev)) == ev


def test_every_event_type_round_trips_through_the_union():
    events = [
        TokenEvent(
            request_id="r1",
            seq=1,
            token_ids=[1],
            text="a",
            logprobs=[
                TokenLogprob(token_id=1, logprob=-0.5, top=[TopLogprob(token_id=2, logprob=-1.5)])
            ],
        ),
        FINAL,
        FINAL.model_copy(
            update={
                "choices": [
                    Choice(index=0, text="abc", finish_reason="length", completion_tokens=3),
                    Choice(
                        index=1,
                        text="x",
                        finish_reason="stop",
                        stop_reason="\n",
                        completion_tokens=1,
                    ),
                ]
            }
        ),
        ErrorEvent(request_id="r1", seq=4, code=ErrorCode.OVERLOADED, message="queue full"),
        ErrorEvent(code="invalid_json", message="bad").with_raw(b"\x00\x01"),
    ]
    adapter = TypeAdapter(OutputEvent)
    for ev in events:
        back = decode_event(encode(ev))
        assert type(back) is type(ev) and back == ev
        assert adapter.validate_json(encode(ev)) == ev


def test_consumers_ignore_unknown_fields():
    wire = json.loads(encode(FINAL))
    wire["a_field_from_the_future"] = {"x": 1}
    wire["usage"]["reasoning_tokens"] = 7
    back = decode_event(json.dumps(wire).encode())
    assert back == FINAL
    assert not hasattr(back, "a_field_from_the_future")


def test_unknown_event_types_are_reported_so_consumers_can_skip_them():
    with pytest.raises(UnknownEventType) as info:
        decode_event(b'{"schema_version": 1, "type": "heartbeat", "request_id": "r1"}')
    assert info.value.event_type == "heartbeat"
    with pytest.raises(UnknownEventType):
        decode_event(b'{"request_id": "r1"}')


def test_malformed_events_raise_value_errors():
    for raw in (
        b"nope",
        b"[1]",
        b'{"type": "token", "request_id": "r1"}',
        b'{"type": "final", "request_id": "r1", "seq": 0}',
    ):
        with pytest.raises(ValueError):
            decode_event(raw)


def test_unknown_error_codes_are_accepted():
    ev = decode_event(b'{"type": "error", "code": "quota_exhausted", "message": "m"}')
    assert ev.code == "quota_exhausted" and ev.request_id is None


def test_error_code_values_are_stable():
    assert [c.value for c in ErrorCode] == [
        "invalid_json",
        "invalid_request",
        "unsupported_schema_version",
        "prompt_too_long",
        "deadline_exceeded",
        "overloaded",
        "internal",
    ]
    assert (
        json.loads(encode(ErrorEvent(code=ErrorCode.INTERNAL, message="x")))["code"] == "internal"
    )


def test_logprobs_are_clamped_to_finite_values():
    lp = TokenLogprob(token_id=1, logprob=float("-inf"), top=[TopLogprob(token_id=2, logprob=1e-9)])
    assert lp.logprob == -9999.0 and lp.top[0].logprob == 0.0
    assert b"Infinity" not in encode(TokenEvent(request_id="r", seq=0, logprobs=[lp]))
    with pytest.raises(ValidationError):
        TopLogprob(token_id=1, logprob=float("nan"))


def test_usage_total_and_timings_nullable():
    assert Usage(prompt_tokens=4, completion_tokens=3).total_tokens == 7
    t = Timings(queue_s=0, total_s=0.1)
    assert t.ttft_s is None and t.tpot_s is None
    assert "ttft_s" not in json.loads(encode(t))  # nulls are left out on the wire
    with pytest.raises(ValidationError):
        Timings(queue_s=-1, total_s=0)


def test_error_for_a_decoded_request_echoes_it():
    req = GenerateRequest(prompt="x", request_id="r9", session_id="s", metadata={"a": 1})
    ev = ErrorEvent.for_request(
        req,
        ErrorCode.PROMPT_TOO_LONG,
        "prompt: 9000 tokens; the context holds 8192",
        field="prompt",
    )
    assert (ev.request_id, ev.session_id, ev.metadata) == ("r9", "s", {"a": 1})
    assert ev.code == "prompt_too_long" and ev.field == "prompt" and ev.raw is None


def test_with_raw_keeps_bytes_and_size():
    ev = ErrorEvent(code="invalid_json", message="m").with_raw(bytes(range(256)) * 2, limit=10)
    assert ev.raw_bytes() == bytes(range(10)) and ev.raw_size == 512
