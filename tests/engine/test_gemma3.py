"""Gemma 3 through the engine: greedy tokens as transformers gives them, on a tiny random model
whose local layers' window is shorter than the prompts, with chunked prefill (a small token
budget), prefix caching and mixed steps; and the layer-by-layer route on every family (the C
layer stack implements the Llama layer alone). The per-position logits are checked in
test_model_vs_hf.py."""

from __future__ import annotations

import copy

import pytest
import torch
from _hf_models import (
    build,
    cpu_families,
    garbage_caches,
    hf_greedy_tokens,
    hf_logits,
    make_prompts,
    prompts,
    rel_err,
    run_in_steps,
    shuffled_tables,
)

from sluice.engine.config import EngineConfig
from sluice.engine.engine import LLMEngine
from sluice.engine.errors import ConfigError
from sluice.engine.forward import LayerByLayer
from sluice.engine.loader import build_model, load_model
from sluice.engine.sampling_params import SamplingParams

GEMMA3 = {
    "num_hidden_layers": 4,
    "sliding_window": 5,
    "sliding_window_pattern": 2,  # local, global, local, global
    "head_dim": 32,
    "query_pre_attn_scalar": 24,
}
# the native family's C prefill kernel serves this head size and block size (its vector shapes)
VECTOR_HEADS = {**GEMMA3, "head_dim": 64}
VECTOR_BLOCK = 16
NEW_TOKENS = 12


def engine(path, kernels: str, **config) -> LLMEngine:
    defaults = dict(kv_cache_bytes=8 << 20, block_size=4, max_num_batched_tokens=20)
    return LLMEngine(
        config=EngineConfig(kernels=kernels, **{**defaults, **config}),
        loaded=load_model(path, load_tokenizer=False),
    )


def greedy(e: LLMEngine, ps) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    return [r.token_ids for r in e.generate(prompt_token_ids=ps, params=params)]


def _saved(tmp_path_factory, overrides: dict):
    path = tmp_path_factory.mktemp("gemma3")
    hf = build("gemma3", **overrides)
    hf.save_pretrained(path)
    return hf, path


@pytest.fixture(scope="module")
def gemma3_dir(tmp_path_factory):
    return _saved(tmp_path_factory, GEMMA3)


@pytest.fixture(scope="module")
def vector_heads_dir(tmp_path_factory):
    return _saved(tmp_path_factory, VECTOR_HEADS)


@pytest.mark.parametrize("kernels", cpu_families())
@pytest.mark.parametrize("shape", ["small heads", "vector heads"])
def test_greedy_tokens_match_transformers(gemma3_dir, vector_heads_dir, kernels, shape):
    hf, path = gemma3_dir if shape == "small heads" else vector_heads_dir
    e = engine(path, kernels, block_size=4 if shape == "small heads" else VECTOR_BLOCK)
    assert e.model_config.architecture == "gemma3"
    assert type(e.runner.route) is LayerByLayer
    ps = prompts(e.model_config.vocab_size)
    want = [hf_greedy_tokens(hf, p, NEW_TOKENS) for p in ps]
    assert greedy(e, ps) == want
    # again, the shared prefix's blocks now read back from the prefix cache
    assert greedy(e, ps[-2:]) == want[-2:]


def test_int8_weights_run_layer_by_layer_on_native(vector_heads_dir):
    if "native" not in cpu_families():
        pytest.skip("the native family is not built here (no C compiler)")
    hf, path = vector_heads_dir
    e = engine(path, "native", quantization="int8", block_size=VECTOR_BLOCK)
    # every matmul weight is packed for C, yet the stack is not chosen: it runs Llama's layer
    assert type(e.runner.route) is LayerByLayer
    got = greedy(e, prompts(e.model_config.vocab_size)[:3])
    assert all(len(tokens) == NEW_TOKENS for tokens in got)


def test_bfloat16_close_to_transformers_bfloat16(gemma3_dir):
    """In bfloat16, rounding where transformers rounds (norms scaled by 1 + weight in float32,
    the embedding scale in bfloat16), the logits stay within bfloat16's few digits of
    transformers' in bfloat16 through local and global layers."""

    hf, path = gemma3_dir
    loaded = load_model(path, load_tokenizer=False)
    cfg = loaded.config
    lengths = [7, 12, 19]
    prompts_ = make_prompts(cfg.vocab_size, lengths)
    model = build_model(cfg, loaded.tensors, "bfloat16")
    caches = garbage_caches(cfg, 24, torch.bfloat16)
    got = run_in_steps(model, prompts_, shuffled_tables(lengths, 24), caches, cfg.sliding_window)
    hf16 = copy.deepcopy(hf).to(torch.bfloat16)
    for g, want in zip(got, hf_logits(hf16, prompts_)):
        assert g.dtype == torch.float32
        assert rel_err(g, want) < 0.05  # (~0.02-0.035 here; transformers' own bf16 is ~0.03 off)


def test_deterministic_mode_is_refused(vector_heads_dir):
    """Its extra norms and GELU run through torch, whose bits may depend on the batch."""
    if "native" not in cpu_families():
        pytest.skip("the native family is not built here (no C compiler)")
    hf, path = vector_heads_dir
    with pytest.raises(ConfigError) as e:
        engine(path, "auto", deterministic=True, block_size=VECTOR_BLOCK)
    assert e.value.field == "deterministic"
