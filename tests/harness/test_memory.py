"""A run with a session continues the session's conversation and, once answered, adds itself to
it: the first turn is asked with the history before the run's messages, the final names that
history (for `sluice replay`), and what the session keeps is the whole run up to its answer. A
verifier's samples read the history and keep nothing; their verifier keeps the chosen answer."""

from __future__ import annotations

from sluice.harness.run import Run
from sluice.harness.verify import Vote
from sluice.schemas.harness import HarnessFinal
from sluice.schemas.tool_messages import ToolCallMessage
from tests.harness.test_run import TOPICS, answer, harness_request, turn

HISTORY = [
    {"role": "user", "content": "Call me Ada."},
    {"role": "assistant", "content": "Hello, Ada."},
]


def test_a_run_goes_on_from_its_sessions_conversation_and_keeps_all_of_itself():
    request = harness_request(session_id="chat-1", tenant="acme")
    run, out = Run.start(request, TOPICS, now=0.0, history=HISTORY)
    ((_, _, first),) = out.records
    assert first["messages"][:2] == HISTORY and first["messages"][2]["content"] == "What is 2 + 3?"
    assert first["tenant"] == "acme" and "session_id" not in first  # (turns are not session turns)

    out = run.on_model_event(turn("run-1.m0", calls=[("add", '{"a": 2, "b": 3}')]), now=1.0)
    (call,) = [m for _, _, m in out.records if isinstance(m, ToolCallMessage)]
    assert run.remembered() is None  # (not done)
    run.on_tool_result(answer(call, "5"), now=2.0)
    out = run.on_model_event(turn("run-1.m1", text="5, Ada."), now=3.0)
    (final,) = [m for _, _, m in out.records if isinstance(m, HarnessFinal)]
    assert final.history == HISTORY

    kept = run.remembered()
    assert kept[:3] == first["messages"] and kept[-1] == {"role": "assistant", "content": "5, Ada."}
    assert [m["role"] for m in kept[3:]] == ["assistant", "tool", "assistant"]


def test_a_run_without_a_session_or_an_answer_keeps_nothing():
    run, _ = Run.start(harness_request(), TOPICS, now=0.0, history=HISTORY)
    run.on_model_event(turn("run-1.m0", text="5"), now=1.0)
    assert run.done and run.remembered() is None

    run, _ = Run.start(harness_request(session_id="chat-1"), TOPICS, now=0.0)
    run.on_model_event(turn("run-1.m0", text="5"), now=1.0)
    assert run.remembered()[-1]["content"] == "5" and run.final_event().history is None
    run, _ = Run.start(harness_request(session_id="chat-1", max_steps=1), TOPICS, now=0.0)
    run.on_model_event(turn("run-1.m0", calls=[("add", "{}")]), now=1.0)
    assert run.remembered() is None  # (ended calling: the session goes on without it)


def test_a_verifiers_samples_read_the_history_and_it_keeps_the_chosen_answer():
    verifier = {"type": "self-consistency", "n": 2}
    request = harness_request(session_id="chat-1", verifier=verifier, temperature=0.7)
    vote, samples, out = Vote.start(request, TOPICS, now=0.0, history=HISTORY)
    assert all(s.state.request.session_id is None for s in samples)
    assert all(body["messages"][:2] == HISTORY for _, _, body in out.records)
    for sample in samples:
        sample.on_model_event(turn(f"{sample.run_id}.m0", text="5"), now=1.0)
        vote.on_sample_final(sample.final_event(), now=1.0)
    assert vote.final_event().history == HISTORY
    assert vote.remembered() == HISTORY + [
        {"role": "user", "content": "What is 2 + 3?"},
        {"role": "assistant", "content": "5"},
    ]
