"""The engine on the Triton kernels (interpreted on the CPU here, compiled on CUDA) gives the same
greedy tokens as on the torch path, for plain, int8-weight and int8-KV models, with chunked
prefill, prefix caching and mixed prefill/decode steps. The kernels alone are checked against
their references in tests/engine/kernels/."""

from __future__ import annotations

import pytest
import torch
from _hf_models import build, prompts

from sluice.engine.config import EngineConfig
from sluice.engine.engine import LLMEngine
from sluice.engine.errors import EngineError
from sluice.engine.kernel_ops import resolve_kernel_ops
from sluice.engine.loader import load_model
from sluice.engine.sampling_params import SamplingParams

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

MODELS = {
    "llama-gqa": ("llama", {}),
    "qwen2-bias-tied": ("qwen2", {"tie_word_embeddings": True}),
    "llama3-rope": (
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
            "num_attention_heads": 6,
            "num_key_value_heads": 2,
            "hidden_size": 96,
        },
    ),
}


def engine(path, kernels: str, **config) -> LLMEngine:
    defaults = dict(kv_cache_bytes=4 << 20, block_size=4, max_num_batched_tokens=20, device=DEVICE)
    return LLMEngine(
        config=EngineConfig(kernels=kernels, **{**defaults, **config}),
        loaded=load_model(path, load_tokenizer=False),
    )


def greedy(e: LLMEngine, ps) -> list[list[int]]:
    return [r.token_ids for r in greedy_results(e, ps)]


def greedy_results(e: LLMEngine, ps):
    return e.generate(
        prompt_token_ids=ps, params=SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    )


def assert_same_greedy_tokens(on_kernels: LLMEngine, on_torch: LLMEngine, min_cached: int) -> None:
    """The same greedy tokens for every prompt, then again for the last two once their shared prefix
    is cached (its blocks read back, not recomputed: at least `min_cached` tokens each)."""
    ps = prompts(on_torch.model_config.vocab_size)
    assert greedy(on_kernels, ps) == greedy(on_torch, ps)
    again_kernels, again_torch = (
        greedy_results(on_kernels, ps[-2:]),
        greedy_results(on_torch, ps[-2:]),
    )
    assert [r.token_ids for r in again_kernels] == [r.token_ids for r in again_torch]
    assert all(r.usage.cached_tokens >= min_cached for r in again_kernels)


# Every model plain; the quantized paths on the GQA model (the interpreter is slow).
CASES = [(name, {}) for name in MODELS] + [
    ("llama-gqa", {"quantization": "int8"}),
    ("llama-gqa", {"kv_cache_dtype": "int8"}),
]


@pytest.mark.parametrize(
    "name,quant",
    CASES,
    ids=[f"{n}-{'-'.join(f'{k}={v}' for k, v in q.items()) or 'plain'}" for n, q in CASES],
)
def test_triton_kernels_give_the_torch_paths_greedy_tokens(tmp_path, name, quant):
    kind, overrides = MODELS[name]
    build(kind, **overrides).save_pretrained(tmp_path)
    on_torch, on_triton = engine(tmp_path, "torch", **quant), engine(tmp_path, "triton", **quant)
    assert on_triton.kernels == "triton" and on_torch.kernels == "torch"
    assert_same_greedy_tokens(on_triton, on_torch, min_cached=20)


def test_sampling_through_the_kernel_is_seeded_and_stays_in_the_kept_set(tmp_path):
    build("llama").save_pretrained(tmp_path)
    e = engine(tmp_path, "triton")
    ps = prompts(e.model_config.vocab_size)[:3]
    params = SamplingParams(
        temperature=0.8, top_k=5, top_p=0.9, max_tokens=8, seed=3, ignore_eos=True
    )
    first = [r.token_ids for r in e.generate(prompt_token_ids=ps, params=params)]
    again = [r.token_ids for r in e.generate(prompt_token_ids=ps, params=params)]
    assert first == again
    assert len({tuple(t) for t in first}) > 1  # the prompts differ, so do their draws


def test_triton_on_the_cpu_without_the_interpreter_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(EngineError, match="TRITON_INTERPRET=1") as e:
        resolve_kernel_ops("triton", "cpu")
    assert e.value.field == "kernels"
    assert resolve_kernel_ops("auto", "cpu").name in (
        "native",
        "torch",
    )  # never Triton without a GPU
    with pytest.raises(EngineError, match="unknown kernels"):
        resolve_kernel_ops("fast", "cpu")
