"""Structured output on the real default model and its tokenizer: sampled JSON validates against
its schema (checked with the `jsonschema` package), each mask is exactly the set of tokens that
keep the text inside the language and never leaves it without a way on (checked against a brute
force over the vocabulary), and a
guided request behaves as any other: n completions, resumed after a crash, refused with a reason
when its format cannot be used."""

from __future__ import annotations

import json

import pytest
from jsonschema import Draft202012Validator
from test_resume import run_to_end

from sluice.engine import LLMEngine, SamplingParams
from sluice.engine.config import EngineConfig
from sluice.engine.errors import EngineError

pytestmark = pytest.mark.slow

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "kind": {"enum": ["river", "lake", "sea"]},
        "depth_m": {"type": "integer", "minimum": 0, "maximum": 11000},
        "towns": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "town": {"type": "string", "maxLength": 12},
                    "size": {"enum": ["small", "large"]},
                },
                "required": ["town", "size"],
                "additionalProperties": False,
            },
            "maxItems": 3,
        },
    },
    "required": ["name", "kind", "depth_m", "towns"],
    "additionalProperties": False,
}
AS_SCHEMA = {"type": "json_schema", "json_schema": {"name": "water", "schema": SCHEMA}}


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    return LLMEngine(None, EngineConfig(kv_cache_bytes=256 << 20, max_num_batched_tokens=1024))


def test_a_hundred_sampled_completions_all_validate_against_the_schema(engine):
    prompts = ["Describe a body of water as JSON, with towns on its shore:"] * 100
    params = [
        SamplingParams(temperature=1.0, max_tokens=200, seed=seed, response_format=AS_SCHEMA)
        for seed in range(100)
    ]
    outputs = engine.generate(prompts, params)
    validator = Draft202012Validator(SCHEMA)
    texts = [o.text for o in outputs]
    assert all(o.finish_reason == "stop" for o in outputs), [o.finish_reason for o in outputs]
    for text in texts:
        assert list(validator.iter_errors(json.loads(text))) == [], text
    assert len(set(texts)) > 50  # sampled: they differ


def allowed_by_brute_force(engine, words: list[str], prefix: bytes) -> set[int]:
    """The tokens that keep `prefix` a prefix of one of `words` (and end of text at a word)."""
    table = engine.tokenizer.token_bytes
    targets = [w.encode() for w in words]
    out = {
        t
        for t, raw in enumerate(table)
        if raw
        and t not in engine.eos_token_ids
        and any(w.startswith(prefix + raw) for w in targets)
    }
    if prefix in targets:
        out |= set(engine.tokenizer.eos_token_ids)
    return out


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_each_mask_keeps_the_text_in_the_language_and_never_blocks_it(engine, seed):
    words = ["river", "lake", "sea", "sea-loch", "Riviera 2"]
    pattern = "river|lake|sea|sea-loch|Riviera 2"
    request = f"walk-{seed}"
    engine.add_request(
        request,
        "The word is:",
        SamplingParams(
            temperature=1.0,
            seed=seed,
            max_tokens=20,
            response_format={"type": "regex", "regex": pattern},
        ),
    )
    (seq,) = engine._requests[request].seqs
    text = b""
    while engine.has_request(request):
        guided = engine.grammars.allowed_tokens([seq.matcher])
        assert guided is not None
        _, bias = guided
        allowed = set((bias[0] == 0).nonzero().flatten().tolist())
        valid = allowed_by_brute_force(engine, words, text)
        # nothing outside the language; never a dead end; never without the only way on
        # (llguidance may leave out some other ways of spelling the same bytes)
        assert allowed and allowed <= valid, (text, allowed - valid)
        if len(valid) == 1:
            assert allowed == valid
        for out in engine.step():
            if out.request_id == request:
                ids = [t for t in out.new_token_ids if t not in engine.eos_token_ids]
                text += b"".join(engine.tokenizer.token_bytes[t] for t in ids)
    assert text.decode() in words


def test_a_single_valid_continuation_is_always_taken(engine):
    forced = {"type": "regex", "regex": r"Paris is in France\."}
    outputs = engine.generate(
        ["Where is Paris?"] * 4,
        [
            SamplingParams(temperature=t, seed=s, max_tokens=30, response_format=forced)
            for t, s in ((0, None), (1.0, 1), (1.5, 2), (1.0, 3))
        ],
    )
    assert [o.text for o in outputs] == ["Paris is in France."] * 4
    assert all(o.finish_reason == "stop" for o in outputs)


def test_a_context_free_grammar(engine):
    nested = {"type": "grammar", "grammar": 'start: "(" inner ")"\ninner: "x" | "(" inner ")"'}
    outputs = engine.generate(
        ["Brackets:"] * 6,
        [
            SamplingParams(temperature=1.0, seed=s, max_tokens=40, response_format=nested)
            for s in range(6)
        ],
    )
    for o in outputs:
        depth = len(o.text) // 2
        assert o.text == "(" * depth + "x" + ")" * depth, o.text


def test_n_completions_and_a_resumed_one_follow_the_format(engine):
    params = SamplingParams(
        temperature=1.0, seed=11, max_tokens=200, n=3, response_format=AS_SCHEMA
    )
    whole, finals = run_to_end(engine, "n3", params, prompt="Describe a lake as JSON:")
    validator = Draft202012Validator(SCHEMA)
    assert sorted(finals) == [0, 1, 2]
    texts = {i: engine.tokenizer.decode(whole[i]) for i in range(3)}
    for text in texts.values():
        assert list(validator.iter_errors(json.loads(text))) == [], text
    # taken up again after a crash, with the tokens it had: the same completions
    cut = {i: ids[: len(ids) // 2] for i, ids in whole.items()}
    again, _ = run_to_end(engine, "n3-again", params, prompt="Describe a lake as JSON:", resume=cut)
    assert {i: cut[i] + again.get(i, []) for i in range(3)} == whole


def test_formats_that_cannot_be_used_are_refused_with_the_reason(engine):
    bad = [
        {
            "type": "json_schema",
            "json_schema": {"schema": {"type": "object", "minProperties": "x"}},
        },
        {"type": "regex", "regex": "(unclosed"},
        {"type": "grammar", "grammar": "start: undefined_rule"},
    ]
    for response_format in bad:
        with pytest.raises(EngineError) as info:
            engine.add_request(None, "x", SamplingParams(response_format=response_format))
        assert info.value.field == "response_format", info.value
    with pytest.raises(EngineError) as info:
        engine.add_request(
            None, "x", SamplingParams(ignore_eos=True, response_format={"type": "json_object"})
        )
    assert info.value.field == "ignore_eos"
    assert not engine.has_unfinished()
