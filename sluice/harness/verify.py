"""A run with a sampling verifier (`HarnessRequest.verifier`) as a state machine with no I/O, as
`run.py`'s runs are: it starts `n` samples, each a whole run of its own (run ids ``RUN.s0``,
``RUN.s1``, ...: their own turns, calls, limits, events and final; seeds ``seed + i``), and once
every sample has ended it chooses the answer:

* **self-consistency**: the answer most samples give (each votes with the last match of
  `answer_pattern` in its answer, or with its whole answer, case and spacing aside; a tie goes to
  the earlier sample);
* **best-of-n**: each answer is scored by a tool (`scorer`, called with ``{question, answer}``
  under key ``RUN/score/i``, its result a number), and the highest score wins.

Only samples that ended with an answer take part. Its own events are the scoring calls and their
results, then one final: the chosen answer, the samples' counts summed, and `candidates` saying
what each sample answered and how it fared. Everything it publishes is named by the run and a
place, as a run's are, so a transition made again publishes the same names.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections import Counter
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from sluice.harness.run import Outbox, Run, Topics, question_of
from sluice.schemas.harness import HarnessFinal, HarnessRequest, HarnessStep, StopReason
from sluice.schemas.tool_messages import ToolCallMessage, ToolResultMessage


class VoteState(BaseModel):
    """A verifier's run as the state topic keeps it."""

    model_config = ConfigDict(extra="ignore")

    request: HarnessRequest
    started_at: float
    samples: list[str]  # their run ids, in order
    history: list[dict[str, Any]] = Field(default_factory=list)  # the session's, before the run
    finals: dict[str, dict[str, Any]] = Field(default_factory=dict)  # sample -> its final
    scores: dict[str, float | None] = Field(default_factory=dict)  # sample -> score (None: none)
    calls: dict[str, str] = Field(default_factory=dict)  # scoring call key -> sample
    phase: Literal["samples", "scoring", "done"] = "samples"
    seq: int = 0
    chosen: str | None = None
    stop_reason: StopReason | None = None
    error: str | None = None
    ended_at: float = 0.0


def sample_seed(request: HarnessRequest, i: int) -> int:
    """Sample i's seed: the run's seed + i, or, without one, one made from the run id (so that
    a transition made again gives its samples the same seeds)."""
    base = request.seed
    if base is None:
        base = int.from_bytes(hashlib.sha256(request.run_id.encode()).digest()[:8], "big")
    return (base + i) % 2**64


def vote_of(answer: str, pattern: str | None) -> str | None:
    """What an answer votes for: the last match of `pattern` (its first group, if it has one),
    or the whole answer, case and spacing aside; None for no vote."""
    if pattern is None:
        said = " ".join(answer.split()).lower()
        return said or None
    matches = list(re.finditer(pattern, answer))
    if not matches:
        return None
    last = matches[-1]
    return last.group(1) if last.re.groups else last.group(0)


class Vote:
    def __init__(self, state: VoteState, topics: Topics):
        self.state = state
        self.topics = topics
        self.now = state.started_at

    @property
    def run_id(self) -> str:
        return self.state.request.run_id

    @property
    def done(self) -> bool:
        return self.state.phase == "done"

    def remembered(self) -> list[dict[str, Any]] | None:
        """The conversation its session keeps once it is done: the question and the chosen
        answer (a sample's own steps stay with the sample); None when it keeps nothing."""
        s, r = self.state, self.state.request
        chosen = s.finals.get(s.chosen or "")
        if r.session_id is None or s.stop_reason != "answer" or chosen is None:
            return None
        asked = [m.model_dump(exclude_none=True) for m in r.messages]
        return s.history + asked + [{"role": "assistant", "content": chosen["answer"]}]

    @classmethod
    def start(
        cls,
        request: HarnessRequest,
        topics: Topics,
        now: float,
        history: list[dict[str, Any]] | None = None,
    ) -> tuple[Vote, list[Run], Outbox]:
        assert request.verifier is not None
        out, samples = Outbox(), []
        for i in range(request.verifier.n):
            sample = request.model_copy(
                update={
                    "run_id": f"{request.run_id}.s{i}",
                    "seed": sample_seed(request, i),
                    "verifier": None,
                    "session_id": None,  # (the verifier's run keeps the chosen answer alone)
                }
            )
            run, started = Run.start(sample, topics, now, sample_of=request.run_id, history=history)
            samples.append(run)
            out.records += started.records
        state = VoteState(
            request=request,
            started_at=now,
            samples=[r.run_id for r in samples],
            history=list(history or []),
        )
        vote = cls(state, topics)
        vote.now = now
        return vote, samples, out

    # -- inputs ------------------------------------------------------------------------------

    def on_sample_final(self, final: HarnessFinal, now: float) -> Outbox:
        out, s, self.now = Outbox(), self.state, now
        if s.phase != "samples" or final.run_id not in s.samples or final.run_id in s.finals:
            return out  # (a copy, or too late)
        s.finals[final.run_id] = final.model_dump(
            mode="json", exclude={"trace", "request", "history"}
        )
        if len(s.finals) == len(s.samples):
            self._all_ended(out)
        return out

    def on_tool_result(self, result: ToolResultMessage, now: float) -> Outbox:
        out, s, self.now = Outbox(), self.state, now
        sample = s.calls.get(result.key)
        if s.phase != "scoring" or sample is None or sample in s.scores:
            return out
        s.scores[sample] = _score(result)
        self._event(out, "tool_result", result=result.model_dump())
        if len(s.scores) == len(s.calls):
            self._choose(out)
        return out

    def on_clock(self, now: float) -> Outbox:
        """Samples end on their own clocks; a scorer that does not answer in the run's time
        leaves its answers unscored."""
        out, s, self.now = Outbox(), self.state, now
        if s.phase == "scoring" and now - s.started_at > s.request.timeout_s:
            for sample in s.calls.values():
                s.scores.setdefault(sample, None)
            self._choose(out)
        return out

    def fail(self, error: str, now: float) -> Outbox:
        out, self.now = Outbox(), now
        if not self.done:
            self._finish(out, "error", error=error)
        return out

    # -- moves -------------------------------------------------------------------------------

    def _answered(self) -> list[str]:
        s = self.state
        return [i for i in s.samples if s.finals[i]["stop_reason"] == "answer"]

    def _all_ended(self, out: Outbox) -> None:
        s, r = self.state, self.state.request
        assert r.verifier is not None
        if r.verifier.type == "self-consistency" or not self._answered():
            self._choose(out)
            return
        s.phase = "scoring"
        question = question_of(r)
        answered = self._answered()
        for i, sample in enumerate(s.samples):
            if sample not in answered:
                continue
            key = f"{self.run_id}/score/{i}"
            s.calls[key] = sample
            call = ToolCallMessage(
                key=key,
                request_id=self.run_id,
                call_id=f"score_{i}",
                name=r.verifier.scorer or "",
                arguments=json.dumps(
                    {"question": question, "answer": s.finals[sample]["answer"]},
                    ensure_ascii=False,
                ),
                reply_topic=self.topics.tool_results,
                deadline=s.started_at + r.timeout_s,
            )
            self._event(out, "tool_call", call=call.model_dump(exclude_none=True))
            out.add(f"{self.topics.tool_prefix}.{call.name}", key, call)

    def _choose(self, out: Outbox) -> None:
        s, r = self.state, self.state.request
        assert r.verifier is not None
        answered = self._answered()
        if r.verifier.type == "self-consistency":
            votes: dict[str, str] = {}
            for i in answered:
                vote = vote_of(s.finals[i]["answer"], r.verifier.answer_pattern)
                if vote is not None:
                    votes[i] = vote
            counts = Counter(votes.values())
            # the most votes; of those, the earliest sample (max keeps the first it meets)
            s.chosen = max(votes, key=lambda i: counts[votes[i]], default=None)
        else:
            scored = [i for i in answered if s.scores.get(i) is not None]
            s.chosen = max(scored, key=lambda i: s.scores[i] or 0.0, default=None)
        if s.chosen is not None:
            self._finish(out, "answer")
        elif answered:
            why = "no answer had a vote" if r.verifier.type == "self-consistency" else "no score"
            self._finish(out, "error", error=f"{why} (answer_pattern or scorer)")
        else:  # no sample answered: the first one's reason speaks for them
            first = s.finals[s.samples[0]]
            self._finish(out, first["stop_reason"], error=first.get("error"))

    def _event(self, out: Outbox, kind: str, **fields: Any) -> None:
        s = self.state
        event = HarnessStep(run_id=self.run_id, seq=s.seq, step=0, kind=kind, **fields)
        s.seq += 1
        out.add(self.topics.events, self.run_id, event)

    def _finish(self, out: Outbox, reason: StopReason, error: str | None = None) -> None:
        s = self.state
        s.phase, s.stop_reason, s.error, s.ended_at = "done", reason, error, self.now
        s.seq += 1
        out.add(self.topics.events, self.run_id, self.final_event())

    def final_event(self) -> HarnessFinal:
        """The final (of a run that is done), the same each time it is made."""
        s, r = self.state, self.state.request
        assert s.stop_reason is not None and r.verifier is not None
        ended = [s.finals[i] for i in s.samples if i in s.finals]
        chosen = s.finals.get(s.chosen or "")
        candidates = []
        for sample in s.samples:
            final = s.finals.get(sample)
            entry: dict[str, Any] = {"run_id": sample}
            if final is not None:
                entry |= {"answer": final["answer"], "stop_reason": final["stop_reason"]}
            if r.verifier.type == "self-consistency" and final is not None:
                entry["vote"] = (
                    vote_of(final["answer"], r.verifier.answer_pattern)
                    if final["stop_reason"] == "answer"
                    else None
                )
            elif sample in s.scores:
                entry["score"] = s.scores[sample]
            candidates.append(entry)
        return HarnessFinal(
            run_id=self.run_id,
            seq=s.seq - 1,
            answer=chosen["answer"] if chosen else "",
            stop_reason=s.stop_reason,
            steps=sum(f["steps"] for f in ended),
            tool_calls=sum(f["tool_calls"] for f in ended) + len(s.calls),
            completion_tokens=sum(f["completion_tokens"] for f in ended),
            prompt_tokens=sum(f["prompt_tokens"] for f in ended),
            seconds=round(max(0.0, s.ended_at - s.started_at), 3),
            error=s.error,
            metadata=r.metadata,
            request=r.model_dump(mode="json", exclude_none=True),
            candidates=candidates,
            provenance=(chosen or (ended[0] if ended else {})).get("provenance"),
            history=s.history or None,
        )


def _score(result: ToolResultMessage) -> float | None:
    if not result.ok:
        return None
    try:
        score = float(result.content.strip())
    except ValueError:
        return None
    return score if score == score and abs(score) != float("inf") else None
