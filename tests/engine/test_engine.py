"""The engine end to end on tiny random models: same greedy tokens as transformers, prefix cache,
preemption, bad input. (The real model's tests are in test_engine_smollm2.py.)"""

from __future__ import annotations

import pytest
import torch
from _hf_models import build

from sluice.engine.config import EngineConfig
from sluice.engine.engine import LLMEngine
from sluice.engine.errors import EngineError, ErrorCode
from sluice.engine.loader import load_model
from sluice.engine.sampling_params import SamplingParams

GREEDY_32 = SamplingParams(temperature=0, max_tokens=32)


def save_tiny(kind: str, path, **overrides):
    model = build(kind, **overrides)
    model.save_pretrained(path)
    return model


def tiny_engine(path, **config) -> LLMEngine:
    defaults = dict(kv_cache_bytes=8 << 20, block_size=4, max_num_batched_tokens=24)
    return LLMEngine(
        config=EngineConfig(**{**defaults, **config}), loaded=load_model(path, load_tokenizer=False)
    )


def hf_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """transformers' greedy generate for one prompt alone; the new tokens (up to and with EOS)."""
    out = model.generate(
        torch.tensor([prompt]),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        do_sample=False,
        max_new_tokens=max_new_tokens,
        pad_token_id=model.config.eos_token_id,
    )
    new = out[0, len(prompt) :].tolist()
    eos = model.config.eos_token_id
    return new[: new.index(eos) + 1] if eos in new else new


def prompts_with_shared_prefix(vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    shared = torch.randint(3, vocab, (40,), generator=g).tolist()
    lengths = [3, 11, 29, 57, 90]
    prompts = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]
    # Two prompts continue a prefix that an earlier request leaves in the cache.
    prompts += [shared + [5, 6, 7], shared + torch.randint(3, vocab, (21,), generator=g).tolist()]
    return prompts, shared


PARITY_MODELS = {
    "llama-gqa": ("llama", {}),
    "qwen2-bias-tied": ("qwen2", {"tie_word_embeddings": True}),
    "llama3-rope-scaling": (
        "llama",
        {
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            },
            "rope_theta": 500000.0,
        },
    ),
}


@pytest.mark.parametrize("name", PARITY_MODELS)
def test_batched_greedy_equals_transformers_alone(name, tmp_path):
    kind, overrides = PARITY_MODELS[name]
    hf = save_tiny(kind, tmp_path, **overrides)
    engine = tiny_engine(tmp_path)
    prompts, shared = prompts_with_shared_prefix(hf.config.vocab_size)
    # Leave the shared prefix in the prefix cache, then run everything together: a 24-token
    # budget forces chunked prefill of the longer prompts, mixed with the others' decodes.
    engine.generate(
        prompt_token_ids=[shared + [9]], params=SamplingParams(temperature=0, max_tokens=1)
    )
    results = engine.generate(prompt_token_ids=prompts, params=GREEDY_32)

    for prompt, result in zip(prompts, results):
        assert result.token_ids == hf_greedy(hf, prompt, 32), f"prompt of {len(prompt)} tokens"
    assert results[-1].usage.cached_tokens >= 40 // 4 * 4 - 4, (
        "the shared prefix came from the cache"
    )
    assert results[-2].usage.cached_tokens > 0


@pytest.mark.parametrize("kernels", ["torch", "native"])
def test_a_lone_prompt_in_chunks_that_sample_nothing_gives_transformers_tokens(tmp_path, kernels):
    """A prompt longer than the step's budget alone: its first steps sample no token, and still
    write its K and V for the chunks after them."""
    hf = save_tiny("llama", tmp_path)
    engine = tiny_engine(tmp_path, max_num_batched_tokens=8, kernels=kernels)
    prompt = [(7 * j) % 97 + 3 for j in range(30)]
    result = engine.generate(prompt_token_ids=[prompt], params=GREEDY_32)[0]
    assert result.token_ids == hf_greedy(hf, prompt, 32)


def test_prefix_cache_reuse_and_tenant_salt(tmp_path):
    save_tiny("llama", tmp_path, max_position_embeddings=1024)
    g = torch.Generator().manual_seed(1)
    prefix = torch.randint(3, 101, (512,), generator=g).tolist()
    first = prefix + torch.randint(3, 101, (9,), generator=g).tolist()
    second = prefix + torch.randint(3, 101, (13,), generator=g).tolist()
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)

    cached = tiny_engine(
        tmp_path, block_size=16, kv_cache_bytes=16 << 20, max_num_batched_tokens=256
    )
    cached.generate(prompt_token_ids=[first], params=params, cache_salt="tenant-a")
    hit = cached.generate(prompt_token_ids=[second], params=params, cache_salt="tenant-a")[0]
    other_tenant = cached.generate(prompt_token_ids=[second], params=params, cache_salt="tenant-b")[
        0
    ]

    uncached = tiny_engine(
        tmp_path,
        block_size=16,
        kv_cache_bytes=16 << 20,
        max_num_batched_tokens=256,
        enable_prefix_caching=False,
    )
    reference = uncached.generate(prompt_token_ids=[second], params=params)[0]

    assert hit.usage.cached_tokens >= 496
    assert hit.token_ids == reference.token_ids
    assert reference.usage.cached_tokens == 0
    assert other_tenant.usage.cached_tokens == 0
    assert other_tenant.token_ids == reference.token_ids


def test_a_kept_turn_is_found_whole_after_others_filled_the_cache(tmp_path):
    """keep_kv through the engine: a turn ends, three long requests fill a small cache, and the
    next turn, extending the first, finds all of its KV (and generates what an uncached engine
    does); without keep_kv the others' blocks had evicted it."""
    save_tiny("llama", tmp_path, max_position_embeddings=1024)
    g = torch.Generator().manual_seed(4)
    first = torch.randint(3, 101, (40,), generator=g).tolist()
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    per_block = tiny_engine(tmp_path).model_config.kv_bytes_per_token(4) * 4

    def second_turn(keep) -> tuple[int, list[int]]:
        engine = tiny_engine(tmp_path, kv_cache_bytes=41 * per_block)
        engine.add_request(prompt_token_ids=first, params=params, keep_kv=keep)
        answer: list[int] = []
        while engine.has_unfinished():
            answer += [t for o in engine.step() for t in o.new_token_ids]
        others = [torch.randint(3, 101, (100,), generator=g).tolist() for _ in range(3)]
        for other in others:
            engine.generate(prompt_token_ids=[other], params=params)
        extended = first + answer + [5, 6, 7]
        out = engine.generate(prompt_token_ids=[extended], params=params)[0]
        return out.usage.cached_tokens, out.token_ids

    kept, kept_ids = second_turn(("run-1", 60.0))
    lost, lost_ids = second_turn(None)
    assert kept == (40 + 8 - 1) // 4 * 4 and lost == 0
    assert kept_ids == lost_ids


def test_preemption_under_a_small_kv_budget_gives_the_same_outputs(tmp_path):
    save_tiny("llama", tmp_path)
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 101, (n,), generator=g).tolist() for n in (30, 45, 20, 60, 38, 25)]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    roomy = tiny_engine(tmp_path).generate(prompt_token_ids=prompts, params=params)

    # 64 blocks of 4 tokens hold 256 tokens; the six requests grow to ~450 together.
    config = tiny_engine(tmp_path).model_config
    per_block = config.kv_bytes_per_token(4) * 4
    tight = tiny_engine(tmp_path, kv_cache_bytes=64 * per_block)
    squeezed = tight.generate(prompt_token_ids=prompts, params=params)

    assert tight.scheduler.num_preemptions > 0
    assert [r.token_ids for r in squeezed] == [r.token_ids for r in roomy]
    assert all(r.finish_reason == "length" and len(r.token_ids) == 40 for r in squeezed)


def test_abort_frees_blocks_at_once_and_reports_a_final_output(tmp_path):
    save_tiny("llama", tmp_path)
    engine = tiny_engine(tmp_path)
    engine.add_request(
        "a",
        prompt_token_ids=list(range(3, 40)),
        params=SamplingParams(max_tokens=50, ignore_eos=True),
    )
    engine.add_request(
        "b",
        prompt_token_ids=list(range(5, 30)),
        params=SamplingParams(max_tokens=5, ignore_eos=True),
    )
    for _ in range(4):
        engine.step()
    free_before = engine.scheduler.block_manager.num_free_blocks
    assert engine.abort("a")
    assert engine.scheduler.block_manager.num_free_blocks > free_before
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step()
    finals = {o.request_id: o for o in outputs if o.finished}
    assert finals["a"].finish_reason == "abort"
    assert finals["b"].finish_reason == "length" and finals["b"].usage.completion_tokens == 5


@pytest.mark.parametrize(
    "bad, field",
    [
        (dict(prompt_token_ids=[]), "prompt"),
        (
            dict(prompt_token_ids=list(range(3, 100)) * 3),
            "prompt",
        ),  # longer than the 256-token context
        (dict(prompt_token_ids=[1, 2], params=SamplingParams(max_tokens=0)), "max_tokens"),
        (dict(prompt_token_ids=[1, 2], params=SamplingParams(top_p=1.5)), "top_p"),
        (dict(prompt_token_ids=[1, 2], params=SamplingParams(top_p=0.0)), "top_p"),
        (dict(prompt_token_ids=[1, 2], params=SamplingParams(temperature=-0.5)), "temperature"),
        (dict(prompt_token_ids=[1, 100_000]), "prompt_token_ids"),
    ],
)
def test_bad_requests_are_rejected_by_field_and_the_engine_keeps_serving(bad, field, tmp_path):
    save_tiny("llama", tmp_path)
    engine = tiny_engine(tmp_path)
    engine.add_request(
        "ok", prompt_token_ids=[4, 5, 6], params=SamplingParams(max_tokens=6, ignore_eos=True)
    )
    engine.step()
    with pytest.raises(EngineError) as err:
        engine.add_request("bad", **bad)
    assert err.value.field == field
    assert field in str(err.value)
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step()
    assert [o.finish_reason for o in outputs if o.finished] == ["length"]
    assert sum(len(o.new_token_ids) for o in outputs) == 5  # 6 tokens, the first came before


def test_errors_carry_a_code_for_what_went_wrong(tmp_path):
    save_tiny("llama", tmp_path)
    engine = tiny_engine(tmp_path)
    cases = [
        (dict(prompt_token_ids=list(range(3, 100)) * 3), ErrorCode.PROMPT_TOO_LONG),
        (
            dict(prompt_token_ids=[1, 2], params=SamplingParams(top_p=1.5)),
            ErrorCode.INVALID_REQUEST,
        ),
    ]
    for bad, code in cases:
        with pytest.raises(EngineError) as err:
            engine.add_request(**bad)
        assert err.value.code == code
    with pytest.raises(EngineError) as err:
        LLMEngine(str(tmp_path / "no-such-model"))
    assert err.value.code == ErrorCode.INVALID_MODEL


def test_unknown_model_path_names_the_path(tmp_path):
    missing = tmp_path / "no-such-model"
    with pytest.raises(EngineError) as err:
        LLMEngine(str(missing))
    assert str(missing) in str(err.value)
    assert err.value.field == "model"


def test_n_samples_share_the_prompt_and_differ(tmp_path):
    save_tiny("llama", tmp_path)
    engine = tiny_engine(tmp_path)
    prompt = list(range(3, 50))
    params = SamplingParams(temperature=1.0, max_tokens=12, n=3, seed=11, ignore_eos=True)
    result = engine.generate(prompt_token_ids=[prompt], params=params)[0]
    assert [s.index for s in result.samples] == [0, 1, 2]
    assert all(len(s.token_ids) == 12 for s in result.samples)
    assert len({tuple(s.token_ids) for s in result.samples}) > 1
    assert result.usage.completion_tokens == 36
    again = engine.generate(prompt_token_ids=[prompt], params=params)[0]
    assert [s.token_ids for s in again.samples] == [s.token_ids for s in result.samples]
