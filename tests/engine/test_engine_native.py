"""The engine on the native CPU kernels (kernels="native", the CPU default: decode and prefill
attention and the layer's norms, rotary and SiLU-and-multiply in C, on the fused forward) gives the
torch path's greedy tokens, with chunked prefill, prefix-cache hits, mixed prefill/decode steps,
shapes the vectorized kernels serve and shapes they do not, and a sliding window. The HF parity
tests (test_model_vs_hf, test_engine_smollm2) run on the default, so on this path too.

In bfloat16 the two paths round at different places, so greedy tokens of random tiny models
(nearly flat logits) part ways; there the native path must be as close to the float32 model as the
torch path is."""

from __future__ import annotations

import _hf_models
import pytest
import torch
from _hf_models import build, garbage_caches, make_prompts, rel_err, run_in_steps, shuffled_tables
from test_engine_kernels import MODELS, assert_same_greedy_tokens, engine

from sluice.engine.cpu_kernels import paged_decode, paged_prefill
from sluice.engine.kernel_ops import resolve_kernel_ops
from sluice.engine.loader import build_model, load_model

# Head size 16 (the tiny models) takes the kernels' generic paths; 64 with block size 16 the
# vectorized decode and prefill kernels.
D64 = {"hidden_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64}
CASES = [(name, 4) for name in MODELS] + [
    ("llama-gqa", 16),
    ("llama-d64", 16),
    ("mistral-window-d64", 16),
]
CASES += [("llama-d64-int8kv", 16)]  # the decode kernel reading the int8 cache directly
ALL_MODELS = {
    **MODELS,
    "llama-d64": ("llama", D64),
    "mistral-window-d64": ("mistral", {**D64, "sliding_window": 24}),
    "llama-d64-int8kv": ("llama", D64),
}


@pytest.mark.parametrize("name,block_size", CASES, ids=[f"{n}-block{b}" for n, b in CASES])
def test_native_gives_the_torch_paths_greedy_tokens(tmp_path, name, block_size):
    kind, overrides = ALL_MODELS[name]
    build(kind, **overrides).save_pretrained(tmp_path)
    config = dict(
        block_size=block_size,
        device="cpu",
        kv_cache_dtype="int8" if name.endswith("int8kv") else "auto",
    )
    on_native, on_torch = engine(tmp_path, "native", **config), engine(tmp_path, "torch", **config)
    assert on_native.kernels == "native" and on_torch.kernels == "torch"
    assert_same_greedy_tokens(on_native, on_torch, min_cached=16)


@pytest.mark.parametrize("name", ["llama-d64", "mistral-window-d64"])
def test_bfloat16_is_as_close_to_float32_as_the_torch_path(tmp_path, monkeypatch, name):
    """Prompt logits through three steps (chunked prefill, then a decode) over 16-token blocks with
    holes and a garbage-filled cache: the bfloat16 model on the C kernels (attention included)
    against the float32 model, no further off than the bfloat16 model on the torch path."""
    kind, overrides = ALL_MODELS[name]
    build(kind, **overrides).save_pretrained(tmp_path)
    loaded = load_model(tmp_path, load_tokenizer=False)
    cfg = loaded.config
    monkeypatch.setattr(_hf_models, "BLOCK", 16)
    lengths = [1, 2, 5, 17, 40, 70]
    prompts, tables = make_prompts(cfg.vocab_size, lengths), shuffled_tables(lengths, 40)
    want = run_in_steps(
        build_model(cfg, loaded.tensors, torch.float32),
        prompts,
        tables,
        garbage_caches(cfg, 40),
        cfg.sliding_window,
    )
    calls = []
    for fn in ("paged_decode_cpu", "paged_prefill_cpu"):
        module = paged_decode if fn == "paged_decode_cpu" else paged_prefill
        real = getattr(module, fn)
        monkeypatch.setattr(
            module, fn, lambda *a, _real=real, _fn=fn, **k: (calls.append(_fn), _real(*a, **k))[1]
        )
    err = {}
    for kernels in ("native", "torch"):
        model = build_model(cfg, loaded.tensors, "bfloat16", ops=resolve_kernel_ops(kernels, "cpu"))
        got = run_in_steps(
            model, prompts, tables, garbage_caches(cfg, 40, torch.bfloat16), cfg.sliding_window
        )
        err[kernels] = max(rel_err(g, w) for g, w in zip(got, want))
    assert {"paged_decode_cpu", "paged_prefill_cpu"} <= set(
        calls
    )  # the bfloat16 attention ran in C
    assert err["native"] < 0.05, err  # bfloat16 keeps ~3 significant digits through the layers
    assert err["native"] <= 1.5 * err["torch"], err
