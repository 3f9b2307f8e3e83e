"""Property tests: anything the models accept survives encode -> decode unchanged."""

from __future__ import annotations

import json

from hypothesis import given, settings

from sluice.schemas import decode_event, decode_request, encode

from .strategies import events, requests


@settings(max_examples=300, deadline=None)
@given(requests())
def test_requests_round_trip(req):
    wire = encode(req)
    back = decode_request(wire)
    assert back == req
    assert encode(back) == wire
    assert json.loads(wire)["request_id"] == req.request_id


@settings(max_examples=300, deadline=None)
@given(events)
def test_events_round_trip(ev):
    back = decode_event(encode(ev))
    assert type(back) is type(ev) and back == ev
