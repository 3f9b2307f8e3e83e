"""The runner's engine thread (`EngineLoop`) on a real (tiny, random-weight) engine: what one step
hands the event loop, refusals with the code the client sees, deadlines, and what a finished
session turn leaves to remember."""

from __future__ import annotations

import time

import pytest

from sluice.actors.conversation import remembered_turn
from sluice.actors.engine_loop import Admission, EngineLoop
from sluice.actors.errors import wire_code
from sluice.actors.messages import TokenizedRequest
from sluice.engine import LLMEngine
from sluice.schemas import GenerateRequest
from sluice.schemas.events import ErrorCode

from .helpers import tiny_engine


@pytest.fixture(scope="module")
def engine(tmp_path_factory) -> LLMEngine:
    return tiny_engine(tmp_path_factory.mktemp("tiny-llama"), max_position_embeddings=64)


def work(request_id: str, prompt_len: int = 5, **fields) -> Admission:
    request = GenerateRequest(
        request_id=request_id,
        prompt="unused: the ids below are the prompt",
        temperature=0,
        ignore_eos=True,
        **fields,
    )
    tokenized = TokenizedRequest(
        request=request, prompt_token_ids=list(range(3, 3 + prompt_len)), received_at=time.time()
    )
    return Admission(tokenized, seed=5)


def run(loop: EngineLoop, steps: int = 100):
    results = []
    while loop.has_work() and steps:
        results.append(loop.step())
        steps -= 1
    return results


def test_a_step_result_carries_tokens_then_the_final(engine):
    loop = EngineLoop(engine)
    loop.accept(work("a", max_tokens=3))
    outputs = [o for r in run(loop) for o in r.outputs]
    assert [len(o.new_token_ids) for o in outputs] == [1, 1, 1]
    assert outputs[-1].finished and outputs[-1].finish_reason == "length"
    assert not loop.has_work()


def test_a_refused_request_is_a_rejection_with_the_clients_code(engine):
    loop = EngineLoop(engine)
    loop.accept(work("too-long", prompt_len=64))  # the context is 64 tokens
    loop.accept(work("fits", max_tokens=2))
    loop.accept(work("ok", max_tokens=2))
    assert loop.has_work()
    first = loop.step()
    assert [r.request_id for r in first.rejections] == ["too-long"]
    assert wire_code(first.rejections[0].error) == ErrorCode.PROMPT_TOO_LONG
    assert first.rejections[0].error.field == "prompt"
    later = run(loop)
    assert not any(r.rejections for r in later)  # handed over once
    assert {o.request_id for r in [first, *later] for o in r.outputs} == {"fits", "ok"}


def test_a_request_past_its_deadline_is_aborted_in_the_step_that_reports_it(engine):
    loop = EngineLoop(engine)
    loop.accept(work("late", max_tokens=50, deadline=time.time() + 0.5))
    assert loop.step().expired == []
    time.sleep(0.6)  # its deadline passes while it generates
    result = loop.step()
    assert result.expired == ["late"]
    final = [o for o in result.outputs if o.finished]
    assert [(o.request_id, o.finish_reason) for o in final] == [("late", "abort")]
    assert not engine.has_request("late")


def test_a_session_turn_remembers_prompt_and_reply_ids():
    chat = GenerateRequest(
        request_id="c", session_id="s", messages=[{"role": "user", "content": "hi"}]
    )
    turn = TokenizedRequest(
        request=chat,
        prompt_token_ids=[1, 2, 3],
        received_at=0.0,
        conversation=[{"role": "user", "content": "hi"}],
    )
    messages, ids = remembered_turn(turn, "hello", [7, 8])
    assert messages == [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
    ]
    assert ids == [1, 2, 3, 7, 8]
    text = GenerateRequest(request_id="t", session_id="s", prompt="Once")
    messages, ids = remembered_turn(
        TokenizedRequest(request=text, prompt_token_ids=[4], received_at=0.0), " upon", [9]
    )
    assert messages == [] and ids == [4, 9]
