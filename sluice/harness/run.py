"""One harness run as a state machine with no I/O: each input (the run's request, a model turn's
final event, a tool's result, the clock) moves it on and returns what to publish (`Outbox`). The
service (`service.py`) publishes that, then keeps the state, then commits the input.

The loop: model turn → its tool calls → their results → the next turn (the conversation so far,
the results as ``tool`` messages) → ... → a turn that calls nothing is the answer. Budgets (turns,
calls, tokens, seconds) and failing tools (several in a row) end it early, each with its own stop
reason. A failed call is shown to the model as an error, so it may correct itself. A call of a
tool marked `needs_approval` waits for an `Approval`: approved, it is published; denied (or not
decided within ``approval_timeout_s``), the model is told so as of a failed call. With a judge
(``verifier.type == "tool"``) an answer is first put to the judging tool: accepted, it ends the
run; rejected, the model is shown why and answers again, up to ``verifier.n`` answers in all.

Everything a run publishes is named by the run and its place in it: model turn ``k`` is request
``RUN.mk``, call ``i`` of turn ``k`` has idempotency key ``RUN/k/i``, events are numbered. A
transition made again (the service stopped after publishing and before keeping the state) publishes
the same names, which the pipeline (by request id), the tool workers (by key) and the run's
readers (by seq) each take once.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from sluice.schemas.events import ErrorEvent, FinalEvent, TokenEvent
from sluice.schemas.harness import (
    Approval,
    HarnessDelta,
    HarnessFinal,
    HarnessRequest,
    HarnessStep,
    StopReason,
)
from sluice.schemas.tool_messages import ToolCallMessage, ToolFailure, ToolResultMessage

# A model turn's KV is kept (pinned in the prefix cache) this long at most for the next turn
KEEP_KV_S = 600.0


@dataclass(frozen=True)
class Topics:
    requests: str  # the pipeline's requests topic
    replies: str  # where model turns' events come back
    events: str  # the run's events, for whoever asked for it
    tool_results: str
    tool_prefix: str  # a tool's calls go to TOOL_PREFIX.<name>


@dataclass
class Outbox:
    """What a transition publishes: (topic, key, message) each; `changed`: whether the run's state
    changed too (then it is kept)."""

    records: list[tuple[str, str, BaseModel | dict[str, Any]]] = field(default_factory=list)
    changed: bool = True

    def add(self, topic: str, key: str, message: BaseModel | dict[str, Any]) -> None:
        self.records.append((topic, key, message))


class RunState(BaseModel):
    """A run as the state topic keeps it."""

    model_config = ConfigDict(extra="ignore")

    request: HarnessRequest
    started_at: float  # unix seconds
    sample_of: str | None = None  # a verifier's sample: the run it is a sample of (`verify.py`)
    history: list[dict[str, Any]] = Field(default_factory=list)  # the session's, before the run
    step: int = 0
    phase: Literal["model", "tools", "judging", "done"] = "model"
    messages: list[dict[str, Any]] = Field(default_factory=list)
    waiting_model: str | None = None  # the request id of the turn it waits for
    calls: dict[str, dict[str, Any]] = Field(default_factory=dict)  # key -> call, this turn's
    results: dict[str, dict[str, Any]] = Field(default_factory=dict)  # key -> result, this turn's
    seq: int = 0
    tool_calls: int = 0
    failures_in_row: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    last_text: str = ""
    provenance: dict[str, Any] | None = None  # of the last model turn
    turns: int = 0  # model turns taken (their final events read)
    turn_cut: bool = False  # the turn under way was given less than max_tokens: what was left
    judged: int = 0  # answers put to the judge (a tool verifier's)
    awaiting: dict[str, float] = Field(default_factory=dict)  # key -> approval expiry (unix s)
    stop_reason: StopReason | None = None
    error: str | None = None
    ended_at: float = 0.0
    trace: list[dict[str, Any]] = Field(default_factory=list)


class Run:
    def __init__(self, state: RunState, topics: Topics):
        self.state = state
        self.topics = topics
        self.now = state.started_at  # the time of the input being handled

    @property
    def run_id(self) -> str:
        return self.state.request.run_id

    @property
    def done(self) -> bool:
        return self.state.phase == "done"

    def remembered(self) -> list[dict[str, Any]] | None:
        """The conversation its session keeps once it is done: all of it, up to the model's last
        words (an answer, one its judge rejected, or one cut by max_tokens, as a chat session
        keeps a turn cut by its length); None when it keeps nothing (no session, or a run that
        ended otherwise)."""
        s = self.state
        if s.request.session_id is None or s.stop_reason not in LAST_WORDS:
            return None
        return s.messages + [{"role": "assistant", "content": s.last_text}]

    @classmethod
    def start(
        cls,
        request: HarnessRequest,
        topics: Topics,
        now: float,
        sample_of: str | None = None,
        history: list[dict[str, Any]] | None = None,
    ) -> tuple[Run, Outbox]:
        """A run of `request`, after `history` (its session's conversation so far)."""
        history = list(history or [])
        state = RunState(
            request=request,
            started_at=now,
            sample_of=sample_of,
            history=history,
            messages=history + [m.model_dump(exclude_none=True) for m in request.messages],
        )
        run = cls(state, topics)
        run.now = now
        out = Outbox()
        run._model_turn(out)
        return run, out

    # -- inputs ------------------------------------------------------------------------------

    def on_model_event(self, event: FinalEvent | ErrorEvent, now: float) -> Outbox:
        out, s, self.now = Outbox(), self.state, now
        if s.phase != "model" or event.request_id != s.waiting_model:
            return out  # (a copy of a turn already taken)
        s.waiting_model = None
        s.turns += 1
        if isinstance(event, ErrorEvent):
            self._finish(out, "error", error=f"model turn {s.step}: {event.code}: {event.message}")
            return out
        s.prompt_tokens += event.usage.prompt_tokens
        s.completion_tokens += event.usage.completion_tokens
        s.last_text = event.text
        calls = [c.model_dump(exclude={"index"}) for c in event.tool_calls or []]
        s.provenance = event.provenance.model_dump() if event.provenance else None
        self._event(
            out,
            "model",
            text=event.text,
            tool_calls=calls or None,
            seed=event.seed,
            provenance=s.provenance,
        )
        if event.finish_reason == "error":
            failure = event.error.message if event.error else "the model turn failed"
            self._finish(out, "error", error=failure)
        elif not calls:
            # a turn cut by its token limit is not an answer (it may be a call half written)
            if event.finish_reason == "length":
                self._finish(out, "budget" if s.turn_cut else "max_tokens")
            elif s.request.verifier is not None and s.request.verifier.judge is not None:
                self._judge(out)
            else:
                self._finish(out, "answer")
        elif s.tool_calls + len(calls) > s.request.max_tool_calls:
            self._finish(out, "max_tool_calls")
        else:
            self._call_tools(out, calls, now)
        return out

    def on_token_event(self, event: TokenEvent) -> Outbox:
        """A token event of the turn under way (a run with ``stream``): its text, passed on as a
        delta; the run's state does not change."""
        out, s = Outbox(changed=False), self.state
        if s.phase == "model" and event.request_id == s.waiting_model:
            if event.index == 0 and (event.text or event.reasoning):
                delta = HarnessDelta(
                    run_id=self.run_id,
                    step=s.step,
                    index=event.seq,
                    text=event.text,
                    reasoning=event.reasoning,
                )
                out.add(self.topics.events, self.run_id, delta)
        return out

    def on_tool_result(self, result: ToolResultMessage, now: float) -> Outbox:
        out, s, self.now = Outbox(), self.state, now
        if s.phase == "judging" and result.key in s.calls and result.key not in s.results:
            s.results[result.key] = result.model_dump()
            self._event(out, "tool_result", result=s.results[result.key])
            self._verdict(out, result, now)
            return out
        if s.phase != "tools" or result.key not in s.calls or result.key in s.results:
            return out  # (another run's, or a copy of one taken)
        s.results[result.key] = result.model_dump()
        self._event(out, "tool_result", result=s.results[result.key])
        if len(s.results) == len(s.calls):
            self._next_turn(out, now)
        return out

    def on_approval(self, approval: Approval, now: float) -> Outbox:
        out, s, self.now = Outbox(), self.state, now
        if s.phase != "tools" or approval.key not in s.awaiting:
            return out  # (another turn's, a second decision, or a copy of one taken)
        del s.awaiting[approval.key]
        self._event(
            out, "approval", approval=approval.model_dump(exclude={"schema_version", "type"})
        )
        if approval.approved:
            self._publish_call(out, self._sent(approval.key, s.calls[approval.key]))
            return out
        why = "the call was not approved" + (f": {approval.reason}" if approval.reason else "")
        self._refused(out, approval.key, "denied", why)
        if len(s.results) == len(s.calls):
            self._next_turn(out, now)
        return out

    def fail(self, error: str, now: float) -> Outbox:
        """End the run with an error (a fault while moving it on)."""
        out, self.now = Outbox(), now
        if not self.done:
            self._finish(out, "error", error=error)
        return out

    def on_clock(self, now: float) -> Outbox:
        out, s, self.now = Outbox(), self.state, now
        if self.done:
            return out
        if now - s.started_at > s.request.timeout_s:
            self._finish(out, "timeout")
            return out
        expired = [key for key, until in s.awaiting.items() if now > until]
        for key in expired:
            del s.awaiting[key]
            self._refused(out, key, "denied", "approval_expired: no decision came in time")
        if expired and len(s.results) == len(s.calls):
            self._next_turn(out, now)
        return out

    # -- moves -------------------------------------------------------------------------------

    def _model_turn(self, out: Outbox) -> None:
        s, r = self.state, self.state.request
        room = r.max_total_tokens - s.completion_tokens
        if room <= 0:
            self._finish(out, "budget")
            return
        request_id = f"{r.run_id}.m{s.step}"
        s.turn_cut = room < r.max_tokens
        body: dict[str, Any] = {
            "request_id": request_id,
            "messages": list(s.messages),  # (a copy: the run goes on appending to its own)
            "tools": [t.model_dump(exclude_none=True) for t in r.tools],
            "tool_choice": _choice(r) if s.step == 0 else "auto",
            "temperature": r.temperature,
            "max_tokens": min(r.max_tokens, room),
            "stream": r.stream,
            "event_format": "sluice",
            "reply_topic": self.topics.replies,
            "metadata": {"harness_run": r.run_id, "step": s.step},
            # the turn's KV kept while its tools run: the next turn extends this conversation
            "keep_kv": {"key": r.run_id, "seconds": min(r.timeout_s, KEEP_KV_S)},
        }
        if r.seed is not None:
            body["seed"] = r.seed
        if r.tenant is not None:
            body["tenant"] = r.tenant
        s.phase, s.waiting_model, s.calls, s.results = "model", request_id, {}, {}
        s.awaiting = {}
        out.add(self.topics.requests, request_id, body)

    def _call_tools(self, out: Outbox, calls: list[dict[str, Any]], now: float) -> None:
        s, r = self.state, self.state.request
        s.messages.append(
            {"role": "assistant", "content": s.last_text or None, "tool_calls": calls}
        )
        s.phase = "tools"
        known = {t.function.name for t in r.tools}
        for i, call in enumerate(calls):
            key = f"{r.run_id}/{s.step}/{i}"
            s.calls[key] = call
            s.tool_calls += 1
            name = call["function"]["name"]
            sent = self._sent(key, call)
            self._event(out, "tool_call", call=sent)
            if name not in known:  # no worker serves it (it may not even be a name): said at once
                why = f"no tool named {name!r} (the tools: {', '.join(sorted(known))})"
                self._refused(out, key, "unknown_tool", why)
            elif name in r.needs_approval:  # published once approved (`on_approval`)
                s.awaiting[key] = now + r.approval_timeout_s
                self._event(out, "awaiting_approval", call=sent)
            else:
                self._publish_call(out, sent)
        if len(s.results) == len(s.calls):
            self._next_turn(out, now)

    def _sent(self, key: str, call: dict[str, Any]) -> dict[str, Any]:
        """A call as its tool_call event shows it (and its `ToolCallMessage` carries it)."""
        return {
            "key": key,
            "request_id": self.run_id,
            "call_id": call["id"],
            "name": call["function"]["name"],
            "arguments": call["function"]["arguments"],
        }

    def _publish_call(self, out: Outbox, sent: dict[str, Any]) -> None:
        s = self.state
        message = ToolCallMessage(
            **sent,
            reply_topic=self.topics.tool_results,
            deadline=s.started_at + s.request.timeout_s,
        )
        out.add(f"{self.topics.tool_prefix}.{sent['name']}", sent["key"], message)

    def _refused(self, out: Outbox, key: str, error: ToolFailure, why: str) -> None:
        """A call answered by the harness itself, as failed: the model is told why."""
        s, call = self.state, self.state.calls[key]
        answer = ToolResultMessage(
            key=key,
            request_id=self.run_id,
            call_id=call["id"],
            name=call["function"]["name"],
            ok=False,
            content=why,
            error=error,
            worker="harness",
        )
        s.results[key] = answer.model_dump()
        self._event(out, "tool_result", result=s.results[key])

    def _next_turn(self, out: Outbox, now: float) -> None:
        s, r = self.state, self.state.request
        for key, call in s.calls.items():
            result = s.results[key]
            content = result["content"]
            if result["ok"]:
                s.failures_in_row = 0
            else:
                s.failures_in_row += 1
                content = f"error ({result.get('error')}): {content}"
            s.messages.append({"role": "tool", "tool_call_id": call["id"], "content": content})
        s.step += 1
        if s.failures_in_row >= r.max_tool_failures:
            self._finish(out, "tool_failures")
        elif s.step >= r.max_steps:
            self._finish(out, "max_steps")
        elif now - s.started_at > r.timeout_s:
            self._finish(out, "timeout")
        else:
            self._model_turn(out)

    def _judge(self, out: Outbox) -> None:
        """Put the answer to the judging tool (under key ``RUN/judge/k``, the k-th answer)."""
        s, r = self.state, self.state.request
        assert r.verifier is not None and r.verifier.judge is not None
        key = f"{r.run_id}/judge/{s.judged}"
        sent: dict[str, Any] = {
            "key": key,
            "request_id": r.run_id,
            "call_id": f"judge_{s.judged}",
            "name": r.verifier.judge,
            "arguments": json.dumps(
                {"question": question_of(r), "answer": s.last_text}, ensure_ascii=False
            ),
        }
        s.judged += 1
        s.phase, s.calls, s.results = "judging", {key: sent}, {}
        self._event(out, "tool_call", call=sent)
        self._publish_call(out, sent)

    def _verdict(self, out: Outbox, result: ToolResultMessage, now: float) -> None:
        s, r = self.state, self.state.request
        assert r.verifier is not None
        if not result.ok:  # (the model cannot mend a judge that fails)
            why = f"the judge {result.name} failed ({result.error}): {result.content}"
            self._finish(out, "tool_failures", error=why)
            return
        passed, feedback = verdict_of(result.content)
        if passed:
            self._finish(out, "answer")
            return
        s.step += 1
        if s.judged >= r.verifier.n:
            self._finish(out, "rejected", error=f"the judge rejected {s.judged} answers")
        elif s.step >= r.max_steps:
            self._finish(out, "max_steps")
        elif now - s.started_at > r.timeout_s:
            self._finish(out, "timeout")
        else:
            s.messages.append({"role": "assistant", "content": s.last_text})
            s.messages.append({"role": "user", "content": REJECTED.format(feedback=feedback)})
            self._model_turn(out)

    def _event(self, out: Outbox, kind: str, **fields: Any) -> None:
        s = self.state
        event = HarnessStep(run_id=self.run_id, seq=s.seq, step=s.step, kind=kind, **fields)
        s.seq += 1
        s.trace.append(_traced(event))
        out.add(self.topics.events, self.run_id, event)

    def _finish(self, out: Outbox, reason: StopReason, error: str | None = None) -> None:
        s = self.state
        s.phase, s.waiting_model, s.stop_reason, s.error = "done", None, reason, error
        s.ended_at = self.now
        s.seq += 1
        out.add(self.topics.events, self.run_id, self.final_event())

    def final_event(self) -> HarnessFinal:
        """The run's final event (of a run that is done), the same each time it is made."""
        s = self.state
        assert s.stop_reason is not None
        return HarnessFinal(
            run_id=self.run_id,
            seq=s.seq - 1,
            answer=s.last_text,
            stop_reason=s.stop_reason,
            steps=s.turns,
            tool_calls=s.tool_calls + s.judged,  # (the judge's calls too)
            completion_tokens=s.completion_tokens,
            prompt_tokens=s.prompt_tokens,
            seconds=round(max(0.0, s.ended_at - s.started_at), 3),
            trace=s.trace,
            error=s.error,
            metadata=s.request.metadata,
            request=s.request.model_dump(mode="json", exclude_none=True),
            provenance=s.provenance,
            history=s.history or None,
        )


TRACED_CHARS = 2000  # of a step's text or result in the trace (the step events have them whole)


def _traced(event: HarnessStep) -> dict[str, Any]:
    """A step as the final's trace keeps it: long texts cut, so that the final stays small."""
    # (a turn's provenance is on its step event, and the last one on the final)
    entry = event.model_dump(exclude={"schema_version", "run_id", "seq", "type", "provenance"})
    if entry.get("text") and len(entry["text"]) > TRACED_CHARS:
        entry["text"] = entry["text"][:TRACED_CHARS] + " [...]"
    result = entry.get("result")
    if result and len(result.get("content", "")) > TRACED_CHARS:
        entry["result"] = {**result, "content": result["content"][:TRACED_CHARS] + " [...]"}
    return entry


# The stop reasons of a run that ended on a turn of the model's calling nothing.
LAST_WORDS = frozenset({"answer", "max_tokens", "rejected"})

# What the model is told of a rejected answer, before it answers again.
REJECTED = "Your answer was checked, and it did not pass:\n{feedback}\nCorrect it and answer again."


def question_of(request: HarnessRequest) -> str | None:
    """What a run's answers answer: its last user message."""
    return next((m.content for m in reversed(request.messages) if m.role == "user"), None)


def verdict_of(content: str) -> tuple[bool, str]:
    """A judge's result as (passed, what the model is shown): it passes when it is JSON true or
    an object with "pass": true; otherwise the model is shown its "feedback" or the whole of it."""
    try:
        said = json.loads(content)
    except ValueError:
        return False, content
    if said is True:
        return True, content
    if isinstance(said, dict):
        feedback = said.get("feedback")
        return said.get("pass") is True, feedback if isinstance(feedback, str) else content
    return False, content


def _choice(request: HarnessRequest) -> Any:
    choice = request.tool_choice
    return choice if isinstance(choice, str) else choice.model_dump()
