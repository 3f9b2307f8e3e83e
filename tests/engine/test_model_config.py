"""ModelConfig from HF config dicts in both the transformers 4.x and 5.x spellings."""

from __future__ import annotations

import pytest

from sluice.engine.config import EngineConfig, ModelConfig
from sluice.engine.errors import EngineError

LLAMA31_V4 = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "max_position_embeddings": 131072,
    "bos_token_id": 128000,
    "eos_token_id": [128001, 128008, 128009],
    "tie_word_embeddings": False,
}


def test_transformers_4_spelling():
    c = ModelConfig.from_hf_dict(LLAMA31_V4)
    assert c.architecture == "llama" and c.head_dim == 128 and c.num_key_value_heads == 8
    assert (
        c.rope_theta == 500000.0
        and c.rope_scaling["rope_type"] == "llama3"
        and c.rope_scaling["factor"] == 8.0
    )
    assert "rope_theta" not in c.rope_scaling
    assert c.eos_token_ids == (128001, 128008, 128009) and c.bos_token_id == 128000
    assert c.kv_bytes_per_token(2) == 2 * 32 * 8 * 128 * 2


def test_transformers_5_spelling_and_old_type_key():
    d = {k: v for k, v in LLAMA31_V4.items() if k not in ("rope_theta", "rope_scaling")}
    d["rope_parameters"] = {"rope_theta": 1e6, "rope_type": "default"}
    c = ModelConfig.from_hf_dict(d)
    assert c.rope_theta == 1e6 and c.rope_scaling is None
    c = ModelConfig.from_hf_dict({**LLAMA31_V4, "rope_scaling": {"type": "linear", "factor": 2.0}})
    assert c.rope_scaling == {"rope_type": "linear", "factor": 2.0}


def test_qwen2_and_mistral_defaults():
    q = ModelConfig.from_hf_dict(
        {
            **LLAMA31_V4,
            "architectures": ["Qwen2ForCausalLM"],
            "rope_scaling": None,
            "tie_word_embeddings": True,
        }
    )
    assert (
        q.architecture == "qwen2"
        and q.attention_bias
        and not q.o_proj_bias
        and q.tie_word_embeddings
    )
    m = ModelConfig.from_hf_dict(
        {
            **LLAMA31_V4,
            "architectures": ["MistralForCausalLM"],
            "rope_scaling": None,
            "sliding_window": 4096,
        }
    )
    assert m.architecture == "mistral" and m.sliding_window == 4096 and not m.attention_bias
    with pytest.raises(EngineError) as e:
        ModelConfig.from_hf_dict(
            {**LLAMA31_V4, "architectures": ["Qwen2ForCausalLM"], "use_sliding_window": True}
        )
    assert e.value.field == "use_sliding_window"


def test_qwen3_and_phi3():
    base = {k: v for k, v in LLAMA31_V4.items() if k != "rope_scaling"}
    q = ModelConfig.from_hf_dict({**base, "architectures": ["Qwen3ForCausalLM"], "head_dim": 64})
    assert q.architecture == "qwen3" and q.qk_norm and not q.plain_layers and q.head_dim == 64
    assert not q.attention_bias  # (Qwen2's default is biased)
    biased = ModelConfig.from_hf_dict(
        {**base, "architectures": ["Qwen3ForCausalLM"], "attention_bias": True}
    )
    assert biased.o_proj_bias  # unlike Qwen2's
    with pytest.raises(EngineError) as e:
        ModelConfig.from_hf_dict(
            {**base, "architectures": ["Qwen3ForCausalLM"], "use_sliding_window": True}
        )
    assert e.value.field == "use_sliding_window"

    phi3 = {**base, "architectures": ["Phi3ForCausalLM"], "sliding_window": 2047}
    p = ModelConfig.from_hf_dict(phi3)
    assert p.architecture == "phi3" and p.sliding_window == 2047 and p.plain_layers
    # transformers 5 keeps the partial rotary factor among the rotary parameters
    partial = {"rope_theta": 1e4, "rope_type": "default", "partial_rotary_factor": 0.75}
    with pytest.raises(EngineError) as e:
        ModelConfig.from_hf_dict({**phi3, "rope_parameters": partial})
    assert e.value.field == "partial_rotary_factor"
    longrope = {"rope_type": "longrope", "short_factor": [1.0], "long_factor": [2.0]}
    with pytest.raises(EngineError) as e:
        ModelConfig.from_hf_dict({**phi3, "rope_scaling": longrope})
    assert e.value.field == "rope_scaling" and "longrope" in str(e.value)


def test_mixtures_of_experts():
    base = {k: v for k, v in LLAMA31_V4.items() if k != "rope_scaling"}
    mixtral = ModelConfig.from_hf_dict(
        {**base, "architectures": ["MixtralForCausalLM"], "num_local_experts": 8,
         "num_experts_per_tok": 2}
    )  # fmt: skip
    assert mixtral.architecture == "mixtral" and mixtral.norm_topk_prob  # (always, for Mixtral)
    assert mixtral.moe_intermediate_size == mixtral.intermediate_size and not mixtral.plain_layers
    qwen2_moe = ModelConfig.from_hf_dict(
        {**base, "architectures": ["Qwen2MoeForCausalLM"], "num_experts": 60,
         "num_experts_per_tok": 4, "moe_intermediate_size": 1408, "decoder_sparse_step": 2,
         "mlp_only_layers": [1], "shared_expert_intermediate_size": 5632}
    )  # fmt: skip
    # every second layer sparse, but layer 1 dense by name
    assert qwen2_moe.dense_layers == tuple(n for n in range(32) if n % 2 == 0 or n == 1)
    assert qwen2_moe.attention_bias and not qwen2_moe.norm_topk_prob  # (qkv_bias's default)
    olmoe = ModelConfig.from_hf_dict(
        {**base, "architectures": ["OlmoeForCausalLM"], "num_experts": 64, "num_experts_per_tok": 8}
    )
    assert olmoe.qk_norm and olmoe.qk_norm_whole
    for bad, field in (
        ({"num_experts_per_tok": 65}, "num_experts_per_tok"),
        ({"clip_qkv": 8.0}, "clip_qkv"),
    ):
        with pytest.raises(EngineError) as e:
            ModelConfig.from_hf_dict(
                {**base, "architectures": ["OlmoeForCausalLM"], "num_experts": 64,
                 "num_experts_per_tok": 8, **bad}
            )  # fmt: skip
        assert e.value.field == field


def test_engine_config_dtype():
    assert str(EngineConfig().torch_dtype) == "torch.float32"
    assert str(EngineConfig(dtype="bfloat16").torch_dtype) == "torch.bfloat16"
    with pytest.raises(EngineError) as e:
        _ = EngineConfig(dtype="int3").torch_dtype
    assert e.value.field == "dtype"


# A Gemma 3 270M-shaped config.json in the transformers 4 spelling (no layer_types: every
# sliding_window_pattern-th layer is global, the pattern's default being 6)
GEMMA3_V4 = {
    "architectures": ["Gemma3ForCausalLM"],
    "model_type": "gemma3_text",
    "hidden_size": 640,
    "intermediate_size": 2048,
    "num_hidden_layers": 18,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 256,
    "vocab_size": 262144,
    "rms_norm_eps": 1e-6,
    "hidden_activation": "gelu_pytorch_tanh",
    "query_pre_attn_scalar": 256,
    "rope_theta": 1000000.0,
    "rope_local_base_freq": 10000.0,
    "rope_scaling": None,
    "sliding_window": 512,
    "max_position_embeddings": 32768,
    "attn_logit_softcapping": None,
    "final_logit_softcapping": None,
    "bos_token_id": 2,
    "eos_token_id": 1,
}


def test_gemma3_local_and_global_layers():
    c = ModelConfig.from_hf_dict(GEMMA3_V4)
    assert c.architecture == "gemma3" and c.head_dim == 256 and c.q_size == 1024
    assert c.tie_word_embeddings and not c.attention_bias and c.hidden_act == "gelu_pytorch_tanh"
    globals_ = [n for n in range(18) if c.layer_window(n) is None]
    assert globals_ == [5, 11, 17]
    assert all(c.layer_window(n) == 512 for n in range(18) if n not in globals_)
    assert c.sliding_window == 512 and c.other_windows == (None,)
    assert c.uses_local_rotary(0) and not c.uses_local_rotary(5)
    assert c.rope_theta == 1e6 and c.local_rope_theta == 1e4 and c.rope_scaling is None
    assert c.attention_scale == 256**-0.5 and c.embedding_scale == 640**0.5
    assert c.norm_adds_one and c.sandwich_norms and c.qk_norm and not c.plain_layers
    assert c.final_logit_softcapping is None and c.eos_token_ids == (1,)


def test_gemma3_transformers_5_spelling():
    d = {
        k: v
        for k, v in GEMMA3_V4.items()
        if k not in ("rope_theta", "rope_local_base_freq", "rope_scaling")
    }
    d["rope_parameters"] = {
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
    }
    d["layer_types"] = ["sliding_attention"] * 3 + ["full_attention"]
    d["num_hidden_layers"] = 4
    d["query_pre_attn_scalar"] = 168
    c = ModelConfig.from_hf_dict(d)
    assert c.layer_windows == (512, 512, 512, None)
    assert c.rope_scaling == {"rope_type": "linear", "factor": 8.0}
    assert c.rope_theta == 1e6 and c.local_rope_theta == 1e4
    assert c.attention_scale == 168**-0.5


def test_gemma3_refusals_and_plain_families():
    for key, value in [
        ("attn_logit_softcapping", 50.0),
        ("use_bidirectional_attention", True),
        ("layer_types", ["full_attention"] * 3),  # not one per layer
        ("hidden_activation", "relu"),
    ]:
        with pytest.raises(EngineError) as e:
            ModelConfig.from_hf_dict({**GEMMA3_V4, key: value})
        assert e.value.field == key
    # GELU is Gemma's: a Llama config asking for it is still refused
    with pytest.raises(EngineError):
        ModelConfig.from_hf_dict({**LLAMA31_V4, "hidden_act": "gelu_pytorch_tanh"})
    llama = ModelConfig.from_hf_dict(LLAMA31_V4)
    assert llama.plain_layers and llama.other_windows == () and llama.attention_scale == 128**-0.5
