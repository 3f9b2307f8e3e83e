"""`sluice replay` of a harness run, the parts that need no model: which record it replays (the
step events, copies taken once, else the final's trace), what it refuses and why, and where a step
or final counts as the same (a text the trace cut short matches what it was cut from). The replay
itself runs against a run served through Kafka (tests/integration/test_harness.py)."""

from __future__ import annotations

import pytest

from sluice.cli.client import ClientError
from sluice.cli.replay_run import CUT, _difference, is_run_record, recorded_run
from sluice.harness.run import TRACED_CHARS

TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
REQUEST = {"run_id": "r1", "messages": [{"role": "user", "content": "hi"}], "tools": [TOOL]}


def step(seq: int, kind: str = "model", **fields) -> dict:
    return {"type": "step", "run_id": "r1", "seq": seq, "step": 0, "kind": kind, **fields}


def final(seq: int, **fields) -> dict:
    return {
        "type": "harness_final",
        "run_id": "r1",
        "seq": seq,
        "answer": "done",
        "stop_reason": "answer",
        "steps": 1,
        "tool_calls": 0,
        "completion_tokens": 3,
        "prompt_tokens": 9,
        "request": REQUEST,
        **fields,
    }


def test_the_step_events_are_the_record_copies_taken_once():
    lines = [step(0, text="done"), step(0, text="done"), final(1), {"type": "token"}]
    assert is_run_record(lines) and not is_run_record([{"type": "final"}])
    record = recorded_run(lines, None)
    assert record.request.run_id == "r1" and record.steps == [step(0, text="done")]
    assert record.final["answer"] == "done"


def test_a_final_alone_is_replayed_from_its_trace():
    trace = [{"step": 0, "kind": "model", "text": "done", "seed": 5}]
    record = recorded_run([final(1, trace=trace)], "r1")
    assert record.steps == trace


@pytest.mark.parametrize(
    "lines, why",
    [
        ([step(0), final(1), {**final(0), "run_id": "r2"}], "name 2 runs: give --run-id"),
        ([step(0)], "has no final event"),
        ([final(0, request=None)], "carries no request"),
        ([final(0, request={**REQUEST, "messages": []})], "not a valid run"),
    ],
)
def test_a_record_it_cannot_replay_is_refused_with_the_reason(lines, why):
    with pytest.raises(ClientError, match=why):
        recorded_run(lines, None)


def test_a_step_differs_by_what_it_was_not_by_when_or_where():
    record = recorded_run([step(0, text="done", seed=5), final(1)], None)
    same = step(0, text="done", seed=5)
    assert _difference(record, 0, {**same, "provenance": {"model": "elsewhere"}}) is None
    assert _difference(record, 0, {**same, "text": "done!"}) == {
        "step": 0,
        "field": "text",
        "recorded": "done",
        "here": "done!",
    }
    here_final = {**final(1), "seconds": 12.5, "trace": []}
    assert _difference(record, 1, here_final) is None
    assert _difference(record, 1, {**here_final, "answer": "no"})["field"] == "answer"
    assert _difference(record, 0, here_final)["field"] == "final"  # (a step less)


def test_a_text_the_trace_cut_matches_what_it_was_cut_from():
    whole = "x" * (TRACED_CHARS + 50)
    record = recorded_run(
        [final(1, trace=[{"step": 0, "kind": "model", "text": whole[:TRACED_CHARS] + CUT}])], None
    )
    assert _difference(record, 0, step(0, text=whole)) is None
    assert _difference(record, 0, step(0, text="y" + whole))["field"] == "text"


def test_a_run_its_clock_stopped_is_compared_up_to_there():
    record = recorded_run([step(0, text="a"), final(1, stop_reason="timeout")], None)
    assert _difference(record, 1, step(1, text="more")) is None
    assert _difference(record, 1, {**final(1), "stop_reason": "answer", "trace": []}) is None
