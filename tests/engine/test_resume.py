"""Resume, never regenerate: a request taken up again with the tokens it had already produced
continues exactly as if it had never stopped (same draws: they depend on seed, completion and
position only), whatever its batch mates, and a request without a seed is given one and reports
it. On a tiny random model (token ids) and on the real default model (text, stop strings)."""

from __future__ import annotations

import pytest
from test_engine import save_tiny, tiny_engine

from sluice.engine.config import EngineConfig
from sluice.engine.engine import LLMEngine
from sluice.engine.errors import EngineError
from sluice.engine.sampling_params import SamplingParams

PROMPT = list(range(3, 40))


def run_to_end(engine: LLMEngine, request_id: str, params: SamplingParams, **kwargs):
    """Step until the request finishes; (token ids per completion, its final outputs)."""
    engine.add_request(request_id, params=params, **kwargs)
    tokens: dict[int, list[int]] = {}
    finals = {}
    while engine.has_request(request_id) or engine.has_unfinished():
        for out in engine.step():
            if out.request_id != request_id:
                continue
            tokens.setdefault(out.index, []).extend(out.new_token_ids)
            if out.finished:
                finals[out.index] = out
    return tokens, finals


@pytest.fixture(scope="module")
def engine(tmp_path_factory) -> LLMEngine:
    path = tmp_path_factory.mktemp("tiny")
    save_tiny("llama", path)
    return tiny_engine(path)


SAMPLED = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=24, ignore_eos=True, seed=7)


@pytest.mark.parametrize("cut", [1, 5, 23])
def test_a_resumed_request_continues_with_the_same_tokens(engine, cut):
    whole, _ = run_to_end(engine, "whole", SAMPLED, prompt_token_ids=PROMPT)
    assert len(whole[0]) == 24
    # beside other requests this time: its draws must not care
    engine.add_request(
        "mate",
        params=SamplingParams(temperature=1.0, max_tokens=30),
        prompt_token_ids=list(range(50, 60)),
    )
    rest, finals = run_to_end(
        engine, "again", SAMPLED, prompt_token_ids=PROMPT, resume={0: whole[0][:cut]}
    )
    assert whole[0][:cut] + rest[0] == whole[0]
    assert finals[0].finish_reason == "length" and finals[0].seed == 7
    assert finals[0].usage.completion_tokens == 24


def test_an_unseeded_request_is_given_a_seed_that_replays_and_resumes_it(engine):
    unseeded = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True)
    first, finals = run_to_end(engine, "u1", unseeded, prompt_token_ids=PROMPT)
    seed = finals[0].seed
    assert isinstance(seed, int) and 0 <= seed < 2**63
    other, other_finals = run_to_end(engine, "u2", unseeded, prompt_token_ids=PROMPT)
    assert other_finals[0].seed != seed  # each request gets its own
    reseeded = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True, seed=seed)
    replay, _ = run_to_end(engine, "u3", reseeded, prompt_token_ids=PROMPT)
    assert replay[0] == first[0]
    rest, _ = run_to_end(engine, "u4", reseeded, prompt_token_ids=PROMPT, resume={0: first[0][:9]})
    assert first[0][:9] + rest[0] == first[0]


def test_every_completion_of_n_resumes_from_its_own_tokens(engine):
    params = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True, n=3, seed=11)
    whole, _ = run_to_end(engine, "n-whole", params, prompt_token_ids=PROMPT)
    assert len({tuple(t) for t in whole.values()}) > 1
    resume = {0: whole[0][:4], 2: whole[2][:11]}  # completion 1 had produced nothing yet
    rest, finals = run_to_end(engine, "n-again", params, prompt_token_ids=PROMPT, resume=resume)
    for index in range(3):
        assert resume.get(index, []) + rest.get(index, []) == whole[index], index
    assert sorted(finals) == [0, 1, 2]


def test_a_request_whose_tokens_had_finished_gets_only_its_final(engine):
    whole, _ = run_to_end(engine, "done", SAMPLED, prompt_token_ids=PROMPT)
    rest, finals = run_to_end(
        engine, "done-again", SAMPLED, prompt_token_ids=PROMPT, resume={0: whole[0]}
    )
    assert rest == {0: []}
    assert finals[0].finish_reason == "length" and finals[0].new_token_ids == []
    eos = engine.model_config.eos_token_ids[0]
    stopped = SamplingParams(temperature=1.0, max_tokens=24, seed=7)
    rest, finals = run_to_end(
        engine, "eos-again", stopped, prompt_token_ids=PROMPT, resume={0: whole[0][:3] + [eos]}
    )
    assert finals[0].finish_reason == "stop" and finals[0].stop_reason == eos
    assert not engine.has_unfinished()


def test_bad_resumes_are_rejected_by_field(engine):
    for resume in ({3: [5]}, {0: [10**9]}, {0: whole_past_max(engine)}):
        with pytest.raises(EngineError) as err:
            engine.add_request("bad", params=SAMPLED, prompt_token_ids=PROMPT, resume=resume)
        assert err.value.field == "resume"
        assert not engine.has_request("bad")
    assert engine.step() == []  # nothing of the refused requests is left behind


def whole_past_max(engine: LLMEngine) -> list[int]:
    return [5] * (SAMPLED.max_tokens + 1)  # one token more than the request may have


@pytest.fixture(scope="module")
def smollm2() -> LLMEngine:
    return LLMEngine(config=EngineConfig(kv_cache_bytes=128 << 20))


def outputs_of(engine: LLMEngine, request_id: str, params, **kwargs):
    engine.add_request(request_id, params=params, **kwargs)
    outs = []
    while engine.has_unfinished():
        outs += [o for o in engine.step() if o.request_id == request_id]
    return outs


def test_text_and_stop_strings_continue_across_the_resume(smollm2):
    """The real model and tokenizer: the resumed request's text deltas continue the published
    text exactly, and a stop string that spans the resume point still ends it where it would."""
    messages = [{"role": "user", "content": "Write two sentences about rivers."}]
    free = SamplingParams(temperature=0.8, max_tokens=40, ignore_eos=True, seed=3)
    full = "".join(o.text for o in outputs_of(smollm2, "free", free, messages=messages))
    assert len(full) > 30
    stop = full[20:26]  # six characters, most likely across a token boundary
    stopping = SamplingParams(temperature=0.8, max_tokens=40, ignore_eos=True, seed=3, stop=[stop])
    whole = outputs_of(smollm2, "whole", stopping, messages=messages)
    whole_text = "".join(o.text for o in whole)
    assert whole[-1].finish_reason == "stop" and whole_text == full[: full.index(stop)]
    tokens = [t for o in whole for t in o.new_token_ids]
    for cut in range(1, len(tokens) + 1):
        # what an uninterrupted run had published with its first `cut` tokens
        published = "".join(o.text for o in whole[:cut])
        again = outputs_of(
            smollm2, f"cut-{cut}", stopping, messages=messages, resume={0: tokens[:cut]}
        )
        assert published + "".join(o.text for o in again) == whole_text, cut
        assert [t for o in again for t in o.new_token_ids] == tokens[cut:], cut
        assert again[-1].finish_reason == "stop" and again[-1].stop_reason == stop, cut
