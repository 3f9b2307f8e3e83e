"""Our decoder against transformers on tiny random models, through the paged cache.

Each prompt runs in three steps (a first prefill chunk, the rest of the prompt, a last single
token as a decode), several prompts of different lengths share each flat batch, block tables are
shuffled with holes, and the cache starts full of garbage: every position's logits must match
transformers' single forward over the whole prompt.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from _hf_models import (
    BLOCK,
    LENGTHS,
    build,
    garbage_caches,
    hf_logits,
    make_prompts,
    rel_err,
    run_in_steps,
    shuffled_tables,
)

from sluice.engine.attention import kv_cache_shape
from sluice.engine.config import EngineConfig
from sluice.engine.loader import build_model, load_model
from sluice.engine.model_runner import ModelRunner, num_kv_blocks
from sluice.engine.paged_cache import LayerKVCache

CASES = {
    "llama_gqa": ("llama", {}),
    "llama_mha_untied": ("llama", {"num_key_value_heads": 4}),
    "llama3_rope": (
        "llama",
        {
            "rope_theta": 50000.0,
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 4.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16,
            },
        },
    ),
    "llama_linear_rope": ("llama", {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}),
    "llama_attention_bias": ("llama", {"attention_bias": True}),
    "qwen2_bias_tied": ("qwen2", {"tie_word_embeddings": True}),
    "qwen2_yarn": (
        "qwen2",
        {
            "max_position_embeddings": 128,
            "rope_scaling": {
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 32,
            },
        },
    ),
    # q and k normed per head before rotary; head_dim other than hidden / heads
    "qwen3_qk_norm": ("qwen3", {"head_dim": 32}),
    # Qwen3's attention_bias is on o_proj too
    "qwen3_bias_tied": ("qwen3", {"attention_bias": True, "tie_word_embeddings": True}),
    # q/k/v and gate/up stored fused; a window over every layer
    "phi3_fused_sliding_window": ("phi3", {"sliding_window": 6}),
    "phi3_no_window": ("phi3", {"sliding_window": None}),
    # mixtures of experts: top 2 of 4 experts renormalized (Mixtral), not renormalized with a
    # shared expert and a dense layer between (Qwen2-MoE), renormalized after QK-norm (Qwen3-MoE)
    "mixtral_top2_of_4": ("mixtral", {"sliding_window": 6}),
    "qwen2_moe_shared_expert": (
        "qwen2_moe",
        {"num_hidden_layers": 3, "mlp_only_layers": [1]},
    ),
    "qwen3_moe_every_other_layer": (
        "qwen3_moe",
        {"num_hidden_layers": 4, "decoder_sparse_step": 2},
    ),
    # q and k normed whole, over all heads, then top 2 of 4 experts not renormalized
    "olmoe_whole_qk_norm": ("olmoe", {}),
    "mistral_sliding_window": ("mistral", {"sliding_window": 6, "head_dim": 16}),
    "mistral_no_window": ("mistral", {"sliding_window": None, "head_dim": 16}),
    # local layers (window 6, shorter than most prompts) between global ones; q/k scaled by
    # query_pre_attn_scalar**-0.5, not head_dim**-0.5
    "gemma3_local_global": (
        "gemma3",
        {
            "num_hidden_layers": 5,
            "sliding_window": 6,
            "sliding_window_pattern": 3,
            "head_dim": 32,
            "query_pre_attn_scalar": 24,
        },
    ),
    # the global layers' rotary scaled, Gemma 2's final logit capping, layer kinds by name
    "gemma3_scaled_rope_capped_logits": (
        "gemma3",
        {
            "num_hidden_layers": 4,
            "layer_types": [
                "full_attention",
                "sliding_attention",
                "sliding_attention",
                "full_attention",
            ],
            "sliding_window": 4,
            "rope_scaling": {"rope_type": "linear", "factor": 2.0},
            "final_logit_softcapping": 3.0,
            "tie_word_embeddings": False,
        },
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_flat_batch_matches_transformers(case, tmp_path):
    kind, overrides = CASES[case]
    hf = build(kind, **overrides)
    hf.save_pretrained(tmp_path)
    loaded = load_model(tmp_path, load_tokenizer=False)
    cfg = loaded.config
    assert cfg.architecture == kind
    if kind in ("mistral", "phi3", "mixtral", "gemma3"):
        assert cfg.sliding_window == overrides["sliding_window"]
    if "tie_word_embeddings" in overrides:
        tied = overrides["tie_word_embeddings"]
        assert cfg.tie_word_embeddings == tied and ("lm_head.weight" in loaded.tensors) != tied
    model = build_model(cfg, loaded.tensors, torch.float32, "cpu")

    prompts = make_prompts(cfg.vocab_size)
    num_blocks = 40
    ours = run_in_steps(
        model,
        prompts,
        shuffled_tables(LENGTHS, num_blocks),
        garbage_caches(cfg, num_blocks),
        cfg.sliding_window,
    )
    for got, want in zip(ours, hf_logits(hf, prompts)):
        assert got.dtype == torch.float32
        assert rel_err(got, want) <= 1e-4


def test_sharded_checkpoint(tmp_path):
    hf = build("llama")
    hf.save_pretrained(tmp_path, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("*.safetensors"))) > 2
    loaded = load_model(str(tmp_path), load_tokenizer=False)
    for name, t in hf.state_dict().items():
        assert torch.equal(loaded.tensors[name], t), name


def test_bfloat16_close_to_float32(tmp_path):
    hf = build("llama")
    hf.save_pretrained(tmp_path)
    loaded = load_model(tmp_path, load_tokenizer=False)
    cfg = loaded.config
    prompts = make_prompts(cfg.vocab_size, [7, 12])
    tables = shuffled_tables([7, 12], 16)
    ref = run_in_steps(
        build_model(cfg, loaded.tensors, torch.float32), prompts, tables, garbage_caches(cfg, 16)
    )
    bf = build_model(cfg, loaded.tensors, "bfloat16")
    assert bf.dtype == torch.bfloat16
    got = run_in_steps(bf, prompts, tables, garbage_caches(cfg, 16, torch.bfloat16))
    for g, r in zip(got, ref):
        assert g.dtype == torch.float32
        assert rel_err(g, r) < 0.05  # bf16 keeps ~3 significant digits through 2 layers


def _seq(tokens, table, computed=0):
    return SimpleNamespace(
        token_ids=list(tokens), num_computed_tokens=computed, block_table=list(table)
    )


def test_model_runner_execute_and_copy_blocks(tmp_path):
    hf = build("qwen2", tie_word_embeddings=True)
    hf.save_pretrained(tmp_path)
    loaded = load_model(tmp_path, load_tokenizer=False)
    cfg = loaded.config
    model = build_model(cfg, loaded.tensors)
    ec = EngineConfig(block_size=BLOCK, kv_cache_bytes=cfg.kv_bytes_per_token(4) * BLOCK * 32)
    assert num_kv_blocks(cfg, ec) == 32
    runner = ModelRunner(model, cfg, ec, 32)
    assert len(runner.kv_caches) == cfg.num_hidden_layers
    assert runner.kv_caches[0].k.shape == kv_cache_shape(
        32, BLOCK, cfg.num_key_value_heads, cfg.head_dim
    )

    a, b = make_prompts(cfg.vocab_size, [10, 6])
    ref_a, ref_b = hf_logits(hf, [a, b])
    sa, sb = _seq(a, [7, 2, 11]), _seq(b, [4, 9])
    # step 1: all of b (sampled) and a chunk of a (not sampled)
    batch = SimpleNamespace(
        seqs=[sb, sa], num_new_tokens=[6, 5], sample=[True, False], block_copies=[]
    )
    logits = runner.execute(batch)
    assert logits.shape == (1, cfg.vocab_size) and logits.dtype == torch.float32
    assert rel_err(logits[0], ref_b[-1]) <= 1e-4
    sa.num_computed_tokens, sb.num_computed_tokens = 5, 6

    # fork a: a copy of a's partly filled block 2 -> 13; the copy continues from there
    sa2 = _seq(a, [7, 2, 13], computed=5)
    batch = SimpleNamespace(
        seqs=[sa, sa2], num_new_tokens=[5, 5], sample=[True, True], block_copies=[(11, 13)]
    )
    logits = runner.execute(batch)
    assert logits.shape == (2, cfg.vocab_size)
    assert rel_err(logits[0], ref_a[-1]) <= 1e-4
    assert rel_err(logits[1], ref_a[-1]) <= 1e-4

    empty = runner.execute(SimpleNamespace(seqs=[], num_new_tokens=[], sample=[], block_copies=[]))
    assert empty.shape == (0, cfg.vocab_size)


def test_num_kv_blocks_defaults():
    from sluice.engine.config import ModelConfig

    cfg = ModelConfig(
        "llama", 100, 64, 128, 2, 4, 2, 16, 1e-5, 1e4, None, 4096, False, False, None, ()
    )
    per_block = cfg.kv_bytes_per_token(4) * 16
    assert num_kv_blocks(cfg, EngineConfig(kv_cache_bytes=per_block * 10 + 5)) == 10
    # bf16 halves the bytes per block
    assert num_kv_blocks(cfg, EngineConfig(kv_cache_bytes=per_block * 10, dtype="bfloat16")) == 20
    # never more than max_num_seqs full-length sequences
    assert num_kv_blocks(cfg, EngineConfig(max_num_seqs=2, max_model_len=64)) == 8
    assert num_kv_blocks(cfg, EngineConfig()) >= 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-3), (torch.bfloat16, 0.05)])
def test_flat_batch_on_cuda(tmp_path, dtype, tol):
    hf = build("llama")
    hf.save_pretrained(tmp_path)
    loaded = load_model(tmp_path, load_tokenizer=False)
    cfg = loaded.config
    model = build_model(cfg, loaded.tensors, dtype, "cuda")
    prompts = make_prompts(cfg.vocab_size)
    caches = [LayerKVCache(*(t.to("cuda") for t in kv)) for kv in garbage_caches(cfg, 40, dtype)]
    # CUDA matmuls may use TF32, hence the looser float32 tolerance
    for got, want in zip(
        run_in_steps(model, prompts, shuffled_tables(LENGTHS, 40), caches), hf_logits(hf, prompts)
    ):
        assert rel_err(got.cpu(), want) <= tol
