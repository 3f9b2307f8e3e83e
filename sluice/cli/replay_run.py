"""`sluice replay` of a harness run: its model turns generated again, in order, each from the
conversation the run had come to, with the recorded tool results standing in for the tools (which
are not run again), and the run's events compared with the recorded ones, step by step, up to the
first difference.

The record is the run's events: `sluice agent run --json` lines, or PREFIX.harness-events on Kafka
(`--run-id`); its final event carries the run's request, and each model turn its seed and
provenance. A final alone (its trace) does too, unless the trace cut a tool result short.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ValidationError

from sluice.cli.client import ClientError
from sluice.cli.replay import engine_as_recorded, expectation, run_alone
from sluice.harness.run import TRACED_CHARS, Outbox, Run, Topics
from sluice.schemas import GenerateRequest
from sluice.schemas.events import FinalEvent, Timings, Usage
from sluice.schemas.harness import HarnessRequest
from sluice.schemas.tool_messages import ToolResultMessage

_TOPICS = Topics(
    requests="requests",
    replies="replies",
    events="events",
    tool_results="tool-results",
    tool_prefix="tools",
)
CUT = " [...]"  # the end of a text the trace cut short


@dataclass
class RecordedRun:
    request: HarnessRequest
    steps: list[dict[str, Any]]  # in order: the step events, or the final's trace
    final: dict[str, Any]

    @property
    def provenance(self) -> dict[str, Any]:
        """The first model turn's, else the final's."""
        for step in self.steps:
            if step.get("kind") == "model" and step.get("provenance"):
                return step["provenance"]
        return self.final.get("provenance") or {}


@dataclass
class RunReport:
    identical: bool
    steps: int  # step events compared
    turns: int  # model turns generated again
    first_difference: dict[str, Any] | None
    provenance_differences: dict[str, tuple[Any, Any]] = field(default_factory=dict)
    expected: bool = False
    why_not: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {
            "identical": self.identical,
            "steps": self.steps,
            "turns": self.turns,
            "first_difference": self.first_difference,
            "provenance_differences": {
                k: {"recorded": a, "here": b} for k, (a, b) in self.provenance_differences.items()
            },
            "expected_to_reproduce": self.expected,
            "why_not": self.why_not,
        }


def is_run_record(lines: list[dict]) -> bool:
    """Whether `lines` are a harness run's events (else a request's)."""
    return any(line.get("type") in ("step", "harness_final") for line in lines)


def recorded_run(lines: list[dict], run_id: str | None) -> RecordedRun:
    """The run in `lines` (harness events; copies taken once, by seq)."""
    events = [
        e
        for e in lines
        if e.get("type") in ("step", "harness_final") and run_id in (None, e.get("run_id"))
    ]
    runs = {e.get("run_id") for e in events}
    if len(runs) != 1:
        raise ClientError(
            f"the events name {len(runs)} runs: give --run-id"
            if runs
            else f"no events of run {run_id!r}"
        )
    by_seq: dict[int, dict] = {}
    for event in events:
        by_seq.setdefault(event["seq"], event)
    finals = [e for e in by_seq.values() if e.get("type") == "harness_final"]
    if not finals:
        raise ClientError(f"run {runs.pop()} has no final event: it has not ended")
    final = finals[0]
    if not final.get("request"):
        raise ClientError("the final event carries no request (a run of an older sluice)")
    try:
        request = HarnessRequest.model_validate_json(json.dumps(final["request"]))
    except ValidationError as exc:
        raise ClientError(f"the recorded request is not a valid run: {exc}") from exc
    steps = [by_seq[s] for s in sorted(by_seq) if by_seq[s].get("type") == "step"]
    if not steps:
        steps = list(final.get("trace") or [])
    return RecordedRun(request, steps, final)


def replay_run(
    recorded: RecordedRun, model: str | None, device: str, kv_cache_bytes: int
) -> RunReport:
    """Run `recorded` again as recorded, up to its first difference."""
    engine = engine_as_recorded(recorded.provenance, model, device, kv_cache_bytes)
    results = {
        step["result"]["key"]: step["result"]
        for step in recorded.steps
        if step.get("kind") == "tool_result"
    }
    seeds = {s["step"]: s.get("seed") for s in recorded.steps if s.get("kind") == "model"}
    now = 0.0  # (the clock is not replayed: a run its clock stopped is compared up to there)
    run, out = Run.start(recorded.request, _TOPICS, now, history=recorded.final.get("history"))
    compared = turns = 0
    pending = list(out.records)
    while pending:
        topic, key, message = pending.pop(0)
        body = message.model_dump(mode="json") if isinstance(message, BaseModel) else message
        if topic == _TOPICS.events:
            difference = _difference(recorded, compared, body)
            if difference is not None:
                return _report(recorded, engine, False, compared, turns, difference)
            compared += body["type"] == "step"
            continue
        moved: Outbox
        if topic == _TOPICS.requests:
            seed = body.get("seed", seeds.get(run.state.step))
            if seed is None:
                difference = {"step": run.state.step, "field": "seed", "recorded": None}
                return _report(recorded, engine, False, compared, turns, difference)
            moved = run.on_model_event(_turn(engine, body, int(seed)), now)
            turns += 1
        else:  # a tool call: answered as recorded
            result = results.get(key)
            if result is None:
                difference = {"step": run.state.step, "field": "tool call", "recorded": None}
                difference["here"] = body
                return _report(recorded, engine, False, compared, turns, difference)
            if result.get("content", "").endswith(CUT) and len(result["content"]) == (
                TRACED_CHARS + len(CUT)
            ):
                raise ClientError(
                    f"the trace cut the result of call {key} short: replay the run's events "
                    "(sluice agent run --json, or --run-id from Kafka) instead of its final"
                )
            moved = run.on_tool_result(ToolResultMessage.model_validate(result), now)
        pending += moved.records
    return _report(recorded, engine, True, compared, turns, None)


def _turn(engine: Any, body: dict[str, Any], seed: int) -> FinalEvent:
    """A model turn generated here, as the pipeline's final event would say it."""
    from sluice.actors.output_reader import OutputReader

    request = GenerateRequest.model_validate_json(json.dumps(body))
    alone = run_alone(engine, request, seed)
    text, reason = alone.texts.get(0, ""), alone.finish_reasons.get(0, "stop")
    calls = reasoning = None
    reader = OutputReader.for_request(request, engine.tokenizer)
    if reader is not None:
        read = reader.ended(0, text)
        text, calls, reasoning = read.content, read.calls or None, read.reasoning or None
        if calls and reason == "stop":
            reason = "tool_calls"
    return FinalEvent(
        request_id=request.request_id,
        seq=len(alone.tokens.get(0, [])),
        finish_reason=reason,
        usage=Usage(
            prompt_tokens=alone.prompt_tokens,
            completion_tokens=sum(len(t) for t in alone.tokens.values()),
        ),
        timings=Timings(queue_s=0.0, total_s=0.0),
        model=engine.provenance.model,
        text=text,
        tool_calls=calls,
        reasoning=reasoning,
        seed=seed,
        provenance=engine.provenance.to_dict(),
    )


def _difference(recorded: RecordedRun, index: int, here: dict[str, Any]) -> dict[str, Any] | None:
    """Where the replayed event `here` (the index-th step, or the final) differs from the
    record; None where it does not."""
    if here["type"] == "harness_final":
        if index != len(recorded.steps):
            return {"step": here.get("steps"), "field": "final", "recorded": "more steps"}
        names = ("stop_reason", "answer", "steps", "tool_calls", "completion_tokens")
        for name in (*names, "prompt_tokens"):
            if name == "stop_reason" and recorded.final["stop_reason"] == "timeout":
                continue  # (the clock stopped it; here nothing does)
            if not _same(recorded.final.get(name), here.get(name)):
                return {
                    "step": "final",
                    "field": name,
                    "recorded": recorded.final.get(name),
                    "here": here.get(name),
                }
        return None
    if index >= len(recorded.steps):
        if recorded.final["stop_reason"] == "timeout":
            return None  # (recorded up to where its clock stopped it)
        return {"step": here["step"], "field": "kind", "recorded": "the end", "here": here["kind"]}
    want = recorded.steps[index]
    for name in ("step", "kind", "text", "tool_calls", "call", "seed"):
        if not _same(want.get(name), here.get(name)):
            recorded_value, here_value = want.get(name), here.get(name)
            return {
                "step": here["step"],
                "field": name,
                "recorded": recorded_value,
                "here": here_value,
            }
    return None


def _same(recorded: Any, here: Any) -> bool:
    if isinstance(recorded, str) and isinstance(here, str) and recorded.endswith(CUT):
        kept = recorded[: -len(CUT)]
        if len(kept) == TRACED_CHARS:
            return here.startswith(kept)
    return recorded == here


def _report(
    recorded: RecordedRun,
    engine: Any,
    identical: bool,
    compared: int,
    turns: int,
    difference: dict[str, Any] | None,
) -> RunReport:
    here = engine.provenance.to_dict()
    expected, why_not = expectation(recorded.provenance, here)
    return RunReport(
        identical,
        compared,
        turns,
        difference,
        engine.provenance.differences(recorded.provenance),
        expected,
        why_not,
    )


def describe_run(recorded: RecordedRun, report: RunReport) -> str:
    run_id = recorded.request.run_id
    if report.identical:
        lines = [
            f"identical: run {run_id}, {report.turns} model turns and {report.steps} steps "
            "(tool results as recorded)"
        ]
    else:
        d = report.first_difference or {}
        lines = [
            f"differs at step {d.get('step')} ({d.get('field')}), after {report.steps} identical "
            f"steps of run {run_id}:",
            f"  recorded: {_shown(d.get('recorded'))}",
            f"  here:     {_shown(d.get('here'))}",
        ]
    if report.expected:
        lines.append("expected to reproduce on any CPU: deterministic mode, the same settings")
    else:
        lines.append("not expected to reproduce: " + "; ".join(report.why_not))
    for name, (a, b) in sorted(report.provenance_differences.items()):
        lines.append(f"  provenance {name}: {a!r} recorded, {b!r} here")
    return "\n".join(lines)


def _shown(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
    return text if len(text) <= 300 else text[:300] + " ..."
