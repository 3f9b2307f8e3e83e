"""A harness run as a state machine: turn → calls → results → next turn → answer, every name it
publishes fixed by the run and its place (so a transition made again publishes the same), copies
of inputs taken once, and each budget ending the run with its own stop reason."""

from __future__ import annotations

import json

from sluice.harness.run import Run, RunState, Topics
from sluice.schemas import decode_request
from sluice.schemas.events import FinalEvent
from sluice.schemas.harness import HarnessFinal, HarnessRequest, HarnessStep
from sluice.schemas.tool_messages import ToolCallMessage, ToolResultMessage

TOPICS = Topics(
    requests="p.requests",
    replies="p.replies.harness",
    events="p.harness-events",
    tool_results="p.tool-results",
    tool_prefix="p.tools",
)
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
        },
    },
}


def harness_request(**fields) -> HarnessRequest:
    body = {
        "run_id": "run-1",
        "messages": [{"role": "user", "content": "What is 2 + 3?"}],
        "tools": [ADD],
        "tool_choice": "required",
        **fields,
    }
    return HarnessRequest.model_validate(body)


def turn(request_id: str, text: str = "", calls: list[tuple[str, str]] = (), tokens: int = 10):
    tool_calls = [
        {"index": i, "id": f"call_{i}", "function": {"name": name, "arguments": arguments}}
        for i, (name, arguments) in enumerate(calls)
    ]
    return FinalEvent.model_validate(
        {
            "request_id": request_id,
            "seq": 1,
            "finish_reason": "tool_calls" if calls else "stop",
            "usage": {"prompt_tokens": 50, "completion_tokens": tokens},
            "timings": {"queue_s": 0, "total_s": 1},
            "model": "m",
            "text": text,
            "tool_calls": tool_calls or None,
        }
    )


def answer(call: ToolCallMessage, content: str, ok: bool = True) -> ToolResultMessage:
    return ToolResultMessage(
        key=call.key,
        request_id=call.request_id,
        call_id=call.call_id,
        name=call.name,
        ok=ok,
        content=content,
        error=None if ok else "failed",
    )


def sent(out, kind):
    return [m for _, _, m in out.records if isinstance(m, kind)]


def test_a_run_calls_its_tools_then_answers():
    run, out = Run.start(harness_request(), TOPICS, now=100.0)
    ((topic, key, body),) = out.records
    assert (topic, key, body["request_id"]) == ("p.requests", "run-1.m0", "run-1.m0")
    assert body["tool_choice"] == "required" and body["reply_topic"] == "p.replies.harness"
    assert body["stream"] is False and body["tools"][0]["function"]["name"] == "add"
    # the turn's KV kept for the next turn while its tools run, and the body a valid request
    assert body["keep_kv"] == {"key": "run-1", "seconds": 600.0}
    assert decode_request(json.dumps(body)).keep_kv is not None

    out = run.on_model_event(turn("run-1.m0", calls=[("add", '{"a": 2, "b": 3}')]), now=101.0)
    (call,) = sent(out, ToolCallMessage)
    assert (call.key, call.request_id, call.name) == ("run-1/0/0", "run-1", "add")
    assert ("p.tools.add", "run-1/0/0") == out.records[-1][:2]
    assert call.reply_topic == "p.tool-results"
    assert [e.kind for e in sent(out, HarnessStep)] == ["model", "tool_call"]

    out = run.on_tool_result(answer(call, "5"), now=102.0)
    next_turn = next(m for t, _, m in out.records if t == "p.requests")
    assert next_turn["request_id"] == "run-1.m1" and next_turn["tool_choice"] == "auto"
    roles = [m["role"] for m in next_turn["messages"]]
    assert roles == ["user", "assistant", "tool"]
    assert next_turn["messages"][2] == {"role": "tool", "tool_call_id": "call_0", "content": "5"}

    out = run.on_model_event(turn("run-1.m1", text="2 + 3 = 5."), now=103.5)
    (final,) = sent(out, HarnessFinal)
    assert (final.answer, final.stop_reason, final.steps, final.tool_calls) == (
        "2 + 3 = 5.",
        "answer",
        2,
        1,
    )
    assert final.completion_tokens == 20 and final.seconds == 3.5
    assert [t["kind"] for t in final.trace] == ["model", "tool_call", "tool_result", "model"]
    seqs = [e.seq for e in sent(out, HarnessStep)] + [final.seq]
    assert seqs == [3, 4] and run.done  # (0 to 2: the first turn, its call and result)


def test_copies_of_inputs_are_taken_once_and_a_transition_made_again_says_the_same():
    run, _ = Run.start(harness_request(), TOPICS, now=0.0)
    model = turn("run-1.m0", calls=[("add", '{"a": 1, "b": 1}'), ("add", '{"a": 2, "b": 2}')])
    kept = RunState.model_validate_json(run.state.model_dump_json())  # what the state topic has
    first = run.on_model_event(model, now=1.0)
    assert run.on_model_event(model, now=1.0).records == []  # the turn's final, again
    again = Run(kept, TOPICS).on_model_event(model, now=1.0)  # stopped before keeping the state
    assert [(t, k, _plain(m)) for t, k, m in again.records] == [
        (t, k, _plain(m)) for t, k, m in first.records
    ]
    calls = sent(first, ToolCallMessage)
    run.on_tool_result(answer(calls[0], "2"), now=2.0)
    assert run.on_tool_result(answer(calls[0], "2"), now=2.0).records == []
    out = run.on_tool_result(answer(calls[1], "4"), now=2.0)
    assert any(t == "p.requests" for t, _, _ in out.records)  # both answered: the next turn


def test_a_call_of_no_such_tool_is_answered_at_once():
    run, _ = Run.start(harness_request(), TOPICS, now=0.0)
    out = run.on_model_event(turn("run-1.m0", calls=[("subtract", "{}")]), now=1.0)
    steps = sent(out, HarnessStep)
    assert [e.kind for e in steps] == ["model", "tool_call", "tool_result"]
    assert steps[1].call is not None and steps[1].call["name"] == "subtract"
    assert not [t for t, _, _ in out.records if t.startswith("p.tools.")]  # nothing published
    (next_turn,) = [m for t, _, m in out.records if t == "p.requests"]
    assert "no tool named 'subtract'" in next_turn["messages"][-1]["content"]


def test_budgets_end_a_run_with_their_stop_reason():
    def final_of(out) -> HarnessFinal:
        (final,) = sent(out, HarnessFinal)
        return final

    # max_steps: two turns that only call
    run, _ = Run.start(harness_request(max_steps=2), TOPICS, now=0.0)
    for step in range(2):
        out = run.on_model_event(turn(f"run-1.m{step}", calls=[("add", "{}")]), now=1.0)
        (call,) = sent(out, ToolCallMessage)
        out = run.on_tool_result(answer(call, "0"), now=1.0)
    assert final_of(out).stop_reason == "max_steps" and run.done

    # max_tool_calls
    run, _ = Run.start(harness_request(max_tool_calls=1), TOPICS, now=0.0)
    out = run.on_model_event(turn("run-1.m0", calls=[("add", "{}"), ("add", "{}")]), now=1.0)
    assert final_of(out).stop_reason == "max_tool_calls"

    # a poison tool: failures in a row, each shown to the model, then the end
    run, _ = Run.start(harness_request(max_tool_failures=2), TOPICS, now=0.0)
    for step in range(2):
        out = run.on_model_event(turn(f"run-1.m{step}", calls=[("add", "{}")]), now=1.0)
        (call,) = sent(out, ToolCallMessage)
        out = run.on_tool_result(answer(call, "boom", ok=False), now=1.0)
    assert final_of(out).stop_reason == "tool_failures"
    assert "error (failed): boom" in run.state.messages[-1]["content"]

    # tokens
    run, _ = Run.start(harness_request(max_total_tokens=15), TOPICS, now=0.0)
    out = run.on_model_event(turn("run-1.m0", calls=[("add", "{}")], tokens=15), now=1.0)
    out = run.on_tool_result(answer(sent(out, ToolCallMessage)[0], "0"), now=1.0)
    assert final_of(out).stop_reason == "budget"

    # seconds
    run, _ = Run.start(harness_request(timeout_s=30), TOPICS, now=0.0)
    assert run.on_clock(29.0).records == []
    assert final_of(run.on_clock(31.0)).stop_reason == "timeout"
    assert run.on_model_event(turn("run-1.m0", text="late"), now=32.0).records == []


def _plain(message):
    return message if isinstance(message, dict) else message.model_dump()


def test_sluice_agent_run_prints_each_step_on_a_line():
    from sluice.cli.agent import _line

    run, _ = Run.start(harness_request(), TOPICS, now=0.0)
    out = run.on_model_event(turn("run-1.m0", calls=[("add", '{"a": 2, "b": 3}')]), now=1.0)
    out.records += run.on_tool_result(answer(sent(out, ToolCallMessage)[0], "5"), 2.0).records
    out.records += run.on_model_event(turn("run-1.m1", text="It is 5."), now=3.0).records
    events = [
        m.model_dump() for _, _, m in out.records if isinstance(m, HarnessStep | HarnessFinal)
    ]
    assert [_line(e) for e in events] == [
        "[turn 0] -> calls add",
        '[call run-1/0/0] add({"a": 2, "b": 3})',
        "[result run-1/0/0] ok: 5",
        "[turn 1] It is 5.",
        "[answer: 2 turns, 1 tool calls, 20 tokens, 3.0 s]",
    ]


def test_a_call_whose_name_is_no_tool_or_no_name_at_all_is_answered_not_raised():
    run, _ = Run.start(harness_request(), TOPICS, now=0.0)
    out = run.on_model_event(turn("run-1.m0", calls=[("python.run", "{}")]), now=1.0)
    assert not [t for t, _, _ in out.records if t.startswith("p.tools.")]
    (next_turn,) = [m for t, _, m in out.records if t == "p.requests"]
    assert "no tool named 'python.run'" in next_turn["messages"][-1]["content"]


def test_a_turn_cut_to_the_tokens_left_ends_the_run_on_its_budget():
    run, _ = Run.start(harness_request(max_total_tokens=100, max_tokens=80), TOPICS, now=0.0)
    out = run.on_model_event(turn("run-1.m0", calls=[("add", "{}")], tokens=60), now=1.0)
    out = run.on_tool_result(answer(sent(out, ToolCallMessage)[0], "0"), now=1.0)
    (next_turn,) = [m for t, _, m in out.records if t == "p.requests"]
    assert next_turn["max_tokens"] == 40  # what is left
    cut = turn("run-1.m1", text='<tool_call>\n{"name": "add", "argu', tokens=40)
    cut = cut.model_copy(update={"finish_reason": "length"})
    (final,) = sent(run.on_model_event(cut, now=2.0), HarnessFinal)
    assert final.stop_reason == "budget" and final.steps == 2
    assert run.final_event() == final  # (made again, e.g. for an asker who missed it)


def test_a_turn_cut_by_its_own_token_limit_is_no_answer():
    run, _ = Run.start(harness_request(max_tokens=30), TOPICS, now=0.0)
    cut = turn("run-1.m0", text='<tool_call>\n{"name": "add", "arguments": {"a', tokens=30)
    cut = cut.model_copy(update={"finish_reason": "length"})
    (final,) = sent(run.on_model_event(cut, now=1.0), HarnessFinal)
    assert final.stop_reason == "max_tokens" and final.answer == cut.text


def test_a_fault_while_moving_a_run_ends_it_with_an_error():
    run, _ = Run.start(harness_request(), TOPICS, now=0.0)
    (final,) = sent(run.fail("the harness failed: boom", now=5.0), HarnessFinal)
    assert final.stop_reason == "error" and final.error == "the harness failed: boom"
    assert run.done and run.fail("again", now=6.0).records == []


def test_a_streamed_runs_turn_passes_its_text_on_as_deltas_and_keeps_nothing():
    from sluice.schemas.events import TokenEvent
    from sluice.schemas.harness import HarnessDelta

    run, out = Run.start(harness_request(stream=True), TOPICS, now=0.0)
    assert out.records[0][2]["stream"] is True
    before = run.state.model_dump_json()

    def token(request_id: str, seq: int, text: str, index: int = 0) -> TokenEvent:
        return TokenEvent(request_id=request_id, seq=seq, index=index, token_ids=[1], text=text)

    out = run.on_token_event(token("run-1.m0", 3, "Let me"))
    ((topic, key, delta),) = out.records
    assert (topic, key, out.changed) == ("p.harness-events", "run-1", False)
    assert isinstance(delta, HarnessDelta)
    assert (delta.step, delta.index, delta.text) == (0, 3, "Let me")
    assert run.state.model_dump_json() == before  # (nothing to keep)
    # another turn's, another completion's, or an empty one: nothing
    assert run.on_token_event(token("run-1.m1", 4, "x")).records == []
    assert run.on_token_event(token("run-1.m0", 4, "x", index=1)).records == []
    assert run.on_token_event(token("run-1.m0", 4, "")).records == []


class _Records:
    """What `sluice agent run` reads: the given events, as a consumer hands them out."""

    def __init__(self, events: list[dict]):
        self.batches = [{"tp": [type("R", (), {"value": json.dumps(e).encode()})]} for e in events]

    async def getmany(self, timeout_ms: int):
        return self.batches.pop(0) if self.batches else {}


async def test_sluice_agent_run_follows_a_streamed_run_to_its_final_in_both_outputs(capsys):
    from sluice.cli.agent import EXIT_OK, _follow

    def delta(step: int, index: int, text: str) -> dict:
        return {"type": "delta", "run_id": "run-1", "step": step, "index": index, "text": text}

    run, _ = Run.start(harness_request(stream=True), TOPICS, now=0.0)
    out = run.on_model_event(turn("run-1.m0", text="It is five, I think."), now=1.0)
    ended = [m.model_dump() for _, _, m in out.records]
    told = [delta(0, 1, "It is "), delta(0, 2, "five"), delta(0, 1, "It is "), *ended]
    told.append({**ended[-1]})  # (a copy of the final)
    for as_json in (False, True):
        code = await _follow(_Records(told), "run-1", as_json, wait=5)
        printed = capsys.readouterr().out.splitlines()
        assert code == EXIT_OK  # (the final read: it does not wait on)
        if as_json:  # each event once, the copies dropped, ending with the final
            assert [json.loads(line)["type"] for line in printed] == [
                "delta",
                "delta",
                "step",
                "harness_final",
            ]
        else:  # the turn's text as it came, then the summary
            assert printed[0] == "[turn 0] It is five" and printed[1].startswith("[answer: 1 turns")
