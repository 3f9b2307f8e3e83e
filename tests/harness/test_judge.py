"""A run with a judging tool (``verifier.type == "tool"``): each answer is put to the judge; an
accepted one ends the run, a rejected one is shown to the model with the judge's reasons and the
model answers again, up to ``n`` answers; every name it publishes fixed by the run and its place."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from sluice.harness.run import Run, RunState, verdict_of
from sluice.schemas.harness import HarnessFinal, HarnessStep
from sluice.schemas.tool_messages import ToolCallMessage
from tests.harness.test_run import TOPICS, _plain, answer, harness_request, turn

JUDGED = {"type": "tool", "judge": "check", "n": 2}


def judged_run(**fields) -> Run:
    request = harness_request(**{"tool_choice": "auto", "verifier": JUDGED, **fields})
    run, _ = Run.start(request, TOPICS, now=0.0)
    return run


def test_an_answer_the_judge_accepts_ends_the_run():
    run = judged_run()
    out = run.on_model_event(turn("run-1.m0", text="It is 5."), now=1.0)
    (call,) = [m for _, _, m in out.records if isinstance(m, ToolCallMessage)]
    assert out.records[-1][:2] == ("p.tools.check", "run-1/judge/0") and not run.done
    assert json.loads(call.arguments) == {"question": "What is 2 + 3?", "answer": "It is 5."}
    assert call.reply_topic == "p.tool-results" and call.request_id == "run-1"

    out = run.on_tool_result(answer(call, '{"pass": true}'), now=2.0)
    (final,) = [m for _, _, m in out.records if isinstance(m, HarnessFinal)]
    assert (final.answer, final.stop_reason, final.tool_calls) == ("It is 5.", "answer", 1)
    kinds = [t["kind"] for t in final.trace]
    assert kinds == ["model", "tool_call", "tool_result"]


def test_a_rejected_answer_is_shown_to_the_model_with_the_judges_reasons():
    run = judged_run()
    out = run.on_model_event(turn("run-1.m0", text="It is 6."), now=1.0)
    (call,) = [m for _, _, m in out.records if isinstance(m, ToolCallMessage)]
    out = run.on_tool_result(answer(call, '{"pass": false, "feedback": "2 + 3 is not 6"}'), 2.0)
    (next_turn,) = [m for t, _, m in out.records if t == "p.requests"]
    assert next_turn["request_id"] == "run-1.m1"
    said = next_turn["messages"][-2:]
    assert said[0] == {"role": "assistant", "content": "It is 6."}
    assert said[1]["role"] == "user" and "2 + 3 is not 6" in said[1]["content"]

    # the second answer is judged under its own key; the judge's last word ends it
    out = run.on_model_event(turn("run-1.m1", text="It is 7."), now=3.0)
    (call,) = [m for _, _, m in out.records if isinstance(m, ToolCallMessage)]
    assert call.key == "run-1/judge/1"
    out = run.on_tool_result(answer(call, "false"), now=4.0)
    (final,) = [m for _, _, m in out.records if isinstance(m, HarnessFinal)]
    assert (final.stop_reason, final.answer, final.steps) == ("rejected", "It is 7.", 2)
    assert "rejected 2 answers" in (final.error or "")


def test_a_judge_that_fails_ends_the_run_and_a_copy_of_its_answer_is_taken_once():
    run = judged_run()
    out = run.on_model_event(turn("run-1.m0", text="It is 5."), now=1.0)
    (call,) = [m for _, _, m in out.records if isinstance(m, ToolCallMessage)]
    kept = RunState.model_validate_json(run.state.model_dump_json())
    failed = answer(call, "Traceback ...", ok=False)
    first = run.on_tool_result(failed, now=2.0)
    assert run.on_tool_result(failed, now=2.0).records == []
    again = Run(kept, TOPICS).on_tool_result(failed, now=2.0)  # stopped before keeping
    assert [_plain(m) for _, _, m in again.records] == [_plain(m) for _, _, m in first.records]
    (final,) = [m for _, _, m in first.records if isinstance(m, HarnessFinal)]
    assert final.stop_reason == "tool_failures" and "the judge check failed" in final.error
    steps = [m for _, _, m in first.records if isinstance(m, HarnessStep)]
    assert [s.kind for s in steps] == ["tool_result"]


def test_a_rejection_at_the_last_step_ends_on_max_steps():
    run = judged_run(max_steps=1, verifier={**JUDGED, "n": 5})
    out = run.on_model_event(turn("run-1.m0", text="It is 6."), now=1.0)
    (call,) = [m for _, _, m in out.records if isinstance(m, ToolCallMessage)]
    out = run.on_tool_result(answer(call, "no"), now=2.0)
    (final,) = [m for _, _, m in out.records if isinstance(m, HarnessFinal)]
    assert final.stop_reason == "max_steps"


@pytest.mark.parametrize(
    "content, passed, shown",
    [
        ("true", True, "true"),
        ('{"pass": true, "feedback": "fine"}', True, "fine"),
        ('{"pass": false, "feedback": "3 tests failed"}', False, "3 tests failed"),
        ('{"pass": "yes"}', False, '{"pass": "yes"}'),
        ("1 passed", False, "1 passed"),
        ("false", False, "false"),
    ],
)
def test_a_verdict_passes_on_json_true_alone(content, passed, shown):
    assert verdict_of(content) == (passed, shown)


def test_a_judge_goes_with_the_tool_verifier_and_needs_no_temperature():
    assert harness_request(verifier=JUDGED).verifier.samples is False  # greedy is fine
    for verifier in (
        {"type": "tool"},
        {"type": "tool", "judge": "check", "scorer": "score"},
        {"type": "self-consistency", "judge": "check"},
    ):
        with pytest.raises(ValidationError):
            harness_request(verifier=verifier, temperature=0.5)
