"""The engine on the native CPU kernels (kernels="native", the CPU default: decode attention and the
layer's norms, rotary and SiLU-and-multiply in C, on the fused forward) gives the torch path's
greedy tokens, with chunked prefill, prefix-cache hits, mixed prefill/decode steps, a block size
the vectorized path serves (16) and one it does not (4), and a sliding window. The HF parity tests
(test_model_vs_hf, test_engine_smollm2) run on the default, so on this path too."""

from __future__ import annotations

import pytest

from _hf_models import build
from test_engine_kernels import MODELS, engine, greedy, greedy_results, prompts

CASES = [(name, 4) for name in MODELS] + [("llama-gqa", 16), ("mistral-window", 16)]
ALL_MODELS = {**MODELS, "mistral-window": ("mistral", {"sliding_window": 24})}


@pytest.mark.parametrize("name,block_size", CASES, ids=[f"{n}-block{b}" for n, b in CASES])
def test_native_gives_the_torch_paths_greedy_tokens(tmp_path, name, block_size):
    kind, overrides = ALL_MODELS[name]
    build(kind, **overrides).save_pretrained(tmp_path)
    on_native = engine(tmp_path, "native", block_size=block_size, device="cpu")
    on_torch = engine(tmp_path, "torch", block_size=block_size, device="cpu")
    assert on_native.kernels == "native" and on_torch.kernels == "torch"
    ps = prompts(on_torch.model_config.vocab_size)
    assert greedy(on_native, ps) == greedy(on_torch, ps)
    again_native, again_torch = greedy_results(on_native, ps[-2:]), greedy_results(on_torch, ps[-2:])
    assert [r.token_ids for r in again_native] == [r.token_ids for r in again_torch]
    assert all(r.usage.cached_tokens >= 16 for r in again_native)

