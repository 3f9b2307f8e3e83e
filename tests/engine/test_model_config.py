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


def test_engine_config_dtype():
    assert str(EngineConfig().torch_dtype) == "torch.float32"
    assert str(EngineConfig(dtype="bfloat16").torch_dtype) == "torch.bfloat16"
    with pytest.raises(EngineError) as e:
        _ = EngineConfig(dtype="int3").torch_dtype
    assert e.value.field == "dtype"
