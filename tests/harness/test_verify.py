"""A run with a verifier as a state machine: its samples are whole runs of their own with seeds of
their own; self-consistency answers with what most samples answer (a tie to the earlier sample),
best-of-n with what the scoring tool scores highest; samples that did not answer take no part,
copies of inputs are taken once, and what it publishes is the same when a transition is made
again."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from sluice.harness.run import Run
from sluice.harness.verify import Vote, sample_seed, vote_of
from sluice.schemas.harness import HarnessFinal, HarnessStep
from sluice.schemas.tool_messages import ToolCallMessage

from .test_run import ADD, TOPICS, answer, harness_request, sent, turn

SELF_CONSISTENCY = {"type": "self-consistency", "n": 3, "answer_pattern": r"-?\d+"}
BEST_OF = {"type": "best-of-n", "n": 3, "scorer": "judge"}


def verified(verifier: dict, **fields):
    request = harness_request(verifier=verifier, temperature=0.7, seed=40, **fields)
    return Vote.start(request, TOPICS, now=10.0)


def ended(sample: Run, text: str, finish_reason: str = "stop") -> HarnessFinal:
    """Sample `sample`'s first turn answers `text`: its final."""
    event = turn(f"{sample.run_id}.m0", text=text)
    (final,) = sent(
        sample.on_model_event(event.model_copy(update={"finish_reason": finish_reason}), 11.0),
        HarnessFinal,
    )
    return final


def test_samples_are_whole_runs_with_seeds_of_their_own():
    vote, samples, out = verified(SELF_CONSISTENCY)
    assert [s.run_id for s in samples] == ["run-1.s0", "run-1.s1", "run-1.s2"]
    turns = [m for t, _, m in out.records if t == TOPICS.requests]
    assert [t["request_id"] for t in turns] == ["run-1.s0.m0", "run-1.s1.m0", "run-1.s2.m0"]
    assert [t["seed"] for t in turns] == [40, 41, 42]
    assert all(s.state.sample_of == "run-1" and s.state.request.verifier is None for s in samples)
    assert {t["temperature"] for t in turns} == {0.7}
    # without a seed the samples' seeds come from the run id: the same when made again
    unseeded = harness_request(verifier=SELF_CONSISTENCY, temperature=0.7)
    assert sample_seed(unseeded, 1) == sample_seed(unseeded, 0) + 1
    again = Vote.start(unseeded, TOPICS, now=99.0)[2]
    assert again.records == Vote.start(unseeded, TOPICS, now=10.0)[2].records


def test_self_consistency_answers_with_what_most_samples_answer():
    vote, samples, _ = verified(SELF_CONSISTENCY)
    texts = ["I get 6.", "2 + 3 makes 5", "The sum is 5."]
    outs = [vote.on_sample_final(ended(s, t), 12.0) for s, t in zip(samples, texts)]
    assert [o.records for o in outs[:2]] == [[], []]
    (final,) = sent(outs[2], HarnessFinal)
    assert final.stop_reason == "answer" and final.answer == "2 + 3 makes 5"
    assert [c["vote"] for c in final.candidates] == ["6", "5", "5"]
    assert final.steps == 3 and final.completion_tokens == 30 and final.prompt_tokens == 150
    assert vote.done and vote.final_event() == final
    # a copy of a sample's final changes nothing
    assert vote.on_sample_final(samples[0].final_event(), 13.0).records == []


def test_a_tie_goes_to_the_earlier_sample_and_samples_without_an_answer_do_not_vote():
    vote, samples, _ = verified({**SELF_CONSISTENCY, "n": 4})
    finals = [
        ended(samples[0], "", "length"),  # cut by max_tokens: no answer
        ended(samples[1], "7"),
        ended(samples[2], "8"),
        ended(samples[3], "no number here"),
    ]
    for final in finals[:3]:
        vote.on_sample_final(final, 12.0)
    (final,) = sent(vote.on_sample_final(finals[3], 12.0), HarnessFinal)
    assert final.answer == "7"
    assert [c.get("vote") for c in final.candidates] == [None, "7", "8", None]
    assert final.candidates[0]["stop_reason"] == "max_tokens"


def test_no_sample_answering_ends_it_as_the_first_one_ended():
    vote, samples, _ = verified({**SELF_CONSISTENCY, "n": 2})
    vote.on_sample_final(ended(samples[0], "", "length"), 12.0)
    (final,) = sent(vote.on_sample_final(ended(samples[1], "", "length"), 12.0), HarnessFinal)
    assert final.stop_reason == "max_tokens" and final.answer == ""


def test_best_of_n_asks_its_scorer_and_answers_with_the_best_scored():
    vote, samples, _ = verified(BEST_OF)
    vote.on_sample_final(ended(samples[0], "five"), 12.0)
    vote.on_sample_final(ended(samples[1], "", "length"), 12.0)
    out = vote.on_sample_final(ended(samples[2], "5"), 12.0)
    calls = sent(out, ToolCallMessage)
    assert [(c.key, c.name) for c in calls] == [
        ("run-1/score/0", "judge"),
        ("run-1/score/2", "judge"),
    ]
    assert [t for t, _, m in out.records if isinstance(m, ToolCallMessage)] == ["p.tools.judge"] * 2
    assert json.loads(calls[1].arguments) == {"question": "What is 2 + 3?", "answer": "5"}
    assert calls[0].reply_topic == TOPICS.tool_results and calls[0].request_id == "run-1"
    assert [e.kind for e in sent(out, HarnessStep)] == ["tool_call", "tool_call"]
    assert vote.on_tool_result(answer(calls[1], "0.9"), 13.0).records[0][2].kind == "tool_result"
    assert vote.on_tool_result(answer(calls[1], "0.1"), 13.0).records == []  # (a copy)
    (final,) = sent(vote.on_tool_result(answer(calls[0], "0.4"), 13.0), HarnessFinal)
    assert final.answer == "5" and final.stop_reason == "answer"
    assert [c.get("score") for c in final.candidates] == [0.4, None, 0.9]
    assert final.tool_calls == 2  # (the scoring calls; the samples made none)


def test_a_scorer_that_fails_or_does_not_answer_leaves_an_answer_unscored():
    vote, samples, _ = verified({**BEST_OF, "n": 2})
    vote.on_sample_final(ended(samples[0], "five"), 12.0)
    calls = sent(vote.on_sample_final(ended(samples[1], "5"), 12.0), ToolCallMessage)
    vote.on_tool_result(answer(calls[0], "not a number"), 13.0)
    assert vote.on_clock(500.0).records == []  # (still within the run's time)
    (final,) = sent(vote.on_clock(10.0 + 601), HarnessFinal)
    assert final.stop_reason == "error" and "no score" in (final.error or "")
    vote2, samples2, _ = verified({**BEST_OF, "n": 2})
    vote2.on_sample_final(ended(samples2[0], "five"), 12.0)
    calls = sent(vote2.on_sample_final(ended(samples2[1], "5"), 12.0), ToolCallMessage)
    vote2.on_tool_result(answer(calls[0], "boom", ok=False), 13.0)
    (final,) = sent(vote2.on_tool_result(answer(calls[1], "3"), 13.0), HarnessFinal)
    assert final.answer == "5"


def test_votes_are_the_patterns_last_match_or_the_answer_itself():
    assert vote_of("first 3, then 4", r"\d+") == "4"
    assert vote_of("x = 12; y = 13", r"y = (\d+)") == "13"
    assert vote_of("no digits", r"\d+") is None
    assert vote_of("  The  Answer\nIS 5 ", None) == "the answer is 5"
    assert vote_of("   ", None) is None


@pytest.mark.parametrize(
    "verifier, temperature, why",
    [
        (SELF_CONSISTENCY, 0.0, "temperature above 0"),
        ({"type": "best-of-n", "n": 3}, 0.7, "needs a scorer"),
        ({**SELF_CONSISTENCY, "answer_pattern": "(unclosed"}, 0.7, "not a regular expression"),
        ({**BEST_OF, "answer_pattern": "x"}, 0.7, "answer_pattern is for self-consistency"),
        ({**SELF_CONSISTENCY, "n": 1}, 0.7, "greater than or equal to 2"),
    ],
)
def test_a_verifier_that_cannot_work_is_refused_with_the_reason(verifier, temperature, why):
    with pytest.raises(ValidationError, match=why):
        harness_request(verifier=verifier, temperature=temperature)


def test_sluice_agent_run_asks_for_a_verifier_and_says_what_it_chose():
    import argparse

    from sluice.cli import agent
    from sluice.cli.client import ClientError

    parser = argparse.ArgumentParser()
    agent.register(parser.add_subparsers())
    ask = ["agent", "run", "What is 2 + 3?", "--tools", json.dumps([ADD]), "--temperature", "1"]
    body = agent.request_body(parser.parse_args([*ask, "--self-consistency", "5"]))
    assert body["verifier"] == {"type": "self-consistency", "n": 5}
    body = agent.request_body(parser.parse_args([*ask, "--best-of", "2", "--scorer", "judge"]))
    assert body["verifier"] == {"type": "best-of-n", "n": 2, "scorer": "judge"}
    with pytest.raises(ClientError, match="--scorer goes with --best-of"):
        agent.request_body(parser.parse_args([*ask, "--scorer", "judge"]))
    body = agent.request_body(parser.parse_args([*ask, "--judge", "check", "--max-answers", "4"]))
    assert body["verifier"] == {"type": "tool", "judge": "check", "n": 4}
    with pytest.raises(ClientError, match="--max-answers with --judge"):
        agent.request_body(parser.parse_args([*ask, "--max-answers", "4"]))
    assert agent._sample("r.s12", "r") and not agent._sample("r.s", "r")
    assert not agent._sample("r.sx", "r") and not agent._sample("q.s1", "r")

    vote, samples, _ = verified(SELF_CONSISTENCY)
    for sample, text in zip(samples, ["5", "It is 5", "6"]):
        out = vote.on_sample_final(ended(sample, text), 12.0)
    (final,) = sent(out, HarnessFinal)
    assert agent._line(final.model_dump()).splitlines() == [
        "[samples s0: votes '5'; s1: votes '5'; s2: votes '6']",
        "5",
        "[answer: 3 turns, 0 tool calls, 30 tokens, 2.0 s]",
    ]
