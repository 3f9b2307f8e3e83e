"""Calls of a tool marked `needs_approval` wait for a decision: approved, the call is published to
its workers; denied, or undecided when its time is up, the model is told so as of a failed call.
The first decision on a call counts; copies and later decisions change nothing."""

from __future__ import annotations

import argparse
import json

import pytest
from pydantic import ValidationError

from sluice.harness.run import Run, RunState
from sluice.schemas.harness import Approval, HarnessStep
from sluice.schemas.tool_messages import ToolCallMessage
from tests.harness.test_run import ADD, TOPICS, _plain, answer, harness_request, turn

TWO_CALLS = [("add", '{"a": 1, "b": 2}'), ("add", '{"a": 3, "b": 4}')]


def waiting_run(**fields) -> tuple[Run, list[HarnessStep]]:
    run, _ = Run.start(harness_request(needs_approval=["add"], **fields), TOPICS, now=0.0)
    out = run.on_model_event(turn("run-1.m0", calls=TWO_CALLS), now=1.0)
    return run, [m for _, _, m in out.records if isinstance(m, HarnessStep)]


def decision(key: str, approved: bool, reason: str | None = None) -> Approval:
    return Approval(run_id="run-1", key=key, approved=approved, reason=reason, by="ops")


def test_a_call_is_published_once_approved_and_a_second_decision_changes_nothing():
    run, steps = waiting_run()
    assert [s.kind for s in steps] == ["model"] + ["tool_call", "awaiting_approval"] * 2
    assert [s.call["key"] for s in steps[2::2]] == ["run-1/0/0", "run-1/0/1"]

    kept = RunState.model_validate_json(run.state.model_dump_json())
    out = run.on_approval(decision("run-1/0/0", True), now=2.0)
    (call,) = [m for _, _, m in out.records if isinstance(m, ToolCallMessage)]
    assert (out.records[-1][0], call.key, call.name) == ("p.tools.add", "run-1/0/0", "add")
    (step,) = [m for _, _, m in out.records if isinstance(m, HarnessStep)]
    assert step.kind == "approval" and step.approval["approved"] and step.approval["by"] == "ops"
    again = Run(kept, TOPICS).on_approval(decision("run-1/0/0", True), now=2.0)
    assert [_plain(m) for _, _, m in again.records] == [_plain(m) for _, _, m in out.records]
    assert run.on_approval(decision("run-1/0/0", True), now=2.5).records == []
    assert run.on_approval(decision("run-1/0/0", False), now=2.5).records == []  # decided

    # the other call denied: the model hears why, with the approved call's result
    out = run.on_approval(decision("run-1/0/1", False, "not on Sundays"), now=3.0)
    assert not [m for _, _, m in out.records if isinstance(m, ToolCallMessage)]
    (refused,) = [m.result for _, _, m in out.records if getattr(m, "kind", "") == "tool_result"]
    assert (refused["ok"], refused["error"]) == (False, "denied")
    assert "not on Sundays" in refused["content"]
    out = run.on_tool_result(answer(call, "3"), now=4.0)
    (next_turn,) = [m for t, _, m in out.records if t == "p.requests"]
    told = [m["content"] for m in next_turn["messages"] if m["role"] == "tool"]
    assert told[0] == "3" and "denied" in told[1] and "not on Sundays" in told[1]


def test_a_call_not_decided_in_time_is_denied_by_the_clock():
    run, _ = waiting_run(approval_timeout_s=30.0)
    assert run.on_clock(now=30.0).records == []  # (made at 1.0: until 31.0)
    out = run.on_clock(now=31.5)
    results = [m.result for _, _, m in out.records if getattr(m, "kind", "") == "tool_result"]
    assert [r["error"] for r in results] == ["denied", "denied"]
    assert all("approval_expired" in r["content"] for r in results)
    assert any(t == "p.requests" for t, _, _ in out.records)  # both answered: the next turn
    assert run.on_approval(decision("run-1/0/0", True), now=32.0).records == []  # too late


def test_approval_is_asked_for_tools_the_run_has():
    with pytest.raises(ValidationError, match="needs_approval names no tool of the run: rm"):
        harness_request(needs_approval=["rm"])
    with pytest.raises(ValidationError):
        Approval.model_validate({"run_id": "r", "key": "k"})  # (approved: yes or no)


def test_sluice_agent_asks_for_approvals_and_shows_them():
    from sluice.cli import agent

    parser = argparse.ArgumentParser()
    agent.register(parser.add_subparsers())
    ask = ["agent", "run", "What is 2 + 3?", "--tools", json.dumps([ADD])]
    ask += ["--needs-approval", "add", "--approval-timeout-s", "60"]
    body = agent.request_body(parser.parse_args(ask))
    assert (body["needs_approval"], body["approval_timeout_s"]) == (["add"], 60.0)
    decided = parser.parse_args(["agent", "approve", "run-1", "run-1/0/0", "--deny"])
    assert (decided.run_id, decided.key, decided.deny) == ("run-1", "run-1/0/0", True)

    _, steps = waiting_run()
    line = agent._line(steps[2].model_dump())
    assert line.startswith("[awaiting approval run-1/0/0] sluice agent approve run-1 run-1/0/0")
    shown = HarnessStep(
        run_id="run-1",
        seq=9,
        step=0,
        kind="approval",
        approval={"key": "run-1/0/1", "approved": False, "reason": "no", "by": "ops"},
    )
    assert agent._line(shown.model_dump()) == "[denied run-1/0/1 by ops] no"
