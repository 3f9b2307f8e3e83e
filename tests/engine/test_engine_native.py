"""The engine on the native CPU kernels (kernels="native", the CPU default: decode and prefill
attention and the layer's norms, rotary and SiLU-and-multiply in C, on the fused forward) gives the
torch path's greedy tokens, with chunked prefill, prefix-cache hits, mixed prefill/decode steps,
shapes the vectorized kernels serve and shapes they do not, and a sliding window. The HF parity tests
(test_model_vs_hf, test_engine_smollm2) run on the default, so on this path too."""

from __future__ import annotations

import pytest

from _hf_models import build
from test_engine_kernels import MODELS, assert_same_greedy_tokens, engine

# Head size 16 (the tiny models) takes the kernels' generic paths; 64 with block size 16 the
# vectorized decode and prefill kernels.
D64 = {"hidden_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64}
CASES = [(name, 4) for name in MODELS] + [("llama-gqa", 16), ("llama-d64", 16), ("mistral-window-d64", 16)]
CASES += [("llama-d64-int8kv", 16)]  # the decode kernel reading the int8 cache directly
ALL_MODELS = {**MODELS, "llama-d64": ("llama", D64), "mistral-window-d64": ("mistral", {**D64, "sliding_window": 24}),
              "llama-d64-int8kv": ("llama", D64)}


@pytest.mark.parametrize("name,block_size", CASES, ids=[f"{n}-block{b}" for n, b in CASES])
def test_native_gives_the_torch_paths_greedy_tokens(tmp_path, name, block_size):
    kind, overrides = ALL_MODELS[name]
    build(kind, **overrides).save_pretrained(tmp_path)
    config = dict(block_size=block_size, device="cpu", kv_cache_dtype="int8" if name.endswith("int8kv") else "auto")
    on_native, on_torch = engine(tmp_path, "native", **config), engine(tmp_path, "torch", **config)
    assert on_native.kernels == "native" and on_torch.kernels == "torch"
    assert_same_greedy_tokens(on_native, on_torch, min_cached=16)

