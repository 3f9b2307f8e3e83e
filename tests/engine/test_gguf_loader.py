"""GGUF loading: dequantization against our own float64 decoders of the block formats, llama.cpp's
Q/K permutation, tiny models written with gguf.GGUFWriter, and the default SmolLM2 file and the
Gemma 3 270M file (where installed) against transformers' own GGUF loader."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from _hf_models import (
    LENGTHS,
    build,
    garbage_caches,
    hf_logits,
    make_prompts,
    plan_for,
    rel_err,
    run_in_steps,
    shuffled_tables,
)
from gguf import GGMLQuantizationType as Q

from sluice.engine.config import EngineConfig
from sluice.engine.engine import LLMEngine
from sluice.engine.errors import EngineError, ModelError
from sluice.engine.loader import build_model, load_model
from sluice.engine.loader import gguf as gguf_loader
from sluice.engine.loader.gguf import SUPPORTED_TYPES, dequantize, permute_qk, unpermute_qk
from sluice.engine.loader.gguf_blocks import int4_blocks
from sluice.engine.rope import RotaryEmbedding, apply_rotary
from tests.hf_reference import reference_model

# --------------------------------------------------------------- reference block decoders (float64)


def _f16(b: np.ndarray) -> np.ndarray:
    return b.copy().view(np.float16).astype(np.float64)[..., 0]


def _ref_simple(blocks: np.ndarray, qtype: Q) -> np.ndarray:
    """Decode [n, type_size] blocks of the 32-element formats into [n, 32]."""
    n = blocks.shape[0]
    out = np.zeros((n, 32))
    for b in range(n):
        blk = blocks[b]
        if qtype == Q.Q8_0:
            out[b] = _f16(blk[0:2]) * blk[2:34].view(np.int8)
            continue
        if qtype in (Q.Q4_0, Q.Q5_0):
            d, m, rest = _f16(blk[0:2]), 0.0, blk[2:]
        else:
            d, m, rest = _f16(blk[0:2]), _f16(blk[2:4]), blk[4:]
        qh = 0
        if qtype in (Q.Q5_0, Q.Q5_1):
            qh = int.from_bytes(rest[:4].tobytes(), "little")
            rest = rest[4:]
        for j in range(16):
            lo, hi = int(rest[j] & 0x0F), int(rest[j] >> 4)
            if qtype in (Q.Q5_0, Q.Q5_1):
                lo |= ((qh >> j) & 1) << 4
                hi |= ((qh >> (j + 16)) & 1) << 4
            off = {Q.Q4_0: 8, Q.Q5_0: 16}.get(qtype, 0)
            out[b, j] = d * (lo - off) + m
            out[b, j + 16] = d * (hi - off) + m
    return out


def _scale_min_k4(j: int, s: np.ndarray) -> tuple[int, int]:
    s = [int(x) for x in s]
    if j < 4:
        return s[j] & 63, s[j + 4] & 63
    return (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4), (s[j + 4] >> 4) | ((s[j] >> 6) << 4)


def _ref_k(blocks: np.ndarray, qtype: Q) -> np.ndarray:
    """Decode [n, type_size] super-blocks of Q4_K / Q5_K / Q6_K into [n, 256]."""
    n = blocks.shape[0]
    out = np.zeros((n, 256))
    for b in range(n):
        blk = blocks[b]
        y = out[b]
        if qtype in (Q.Q4_K, Q.Q5_K):
            d, dmin, scales = _f16(blk[0:2]), _f16(blk[2:4]), blk[4:16]
            qh = blk[16:48] if qtype == Q.Q5_K else None
            qs = blk[48:176] if qtype == Q.Q5_K else blk[16:144]
            for g in range(4):  # 64 values per group: low nibbles then high nibbles of 32 bytes
                sc1, m1 = _scale_min_k4(2 * g, scales)
                sc2, m2 = _scale_min_k4(2 * g + 1, scales)
                for i in range(32):
                    lo, hi = int(qs[32 * g + i] & 0xF), int(qs[32 * g + i] >> 4)
                    if qh is not None:
                        lo += 16 if qh[i] & (1 << (2 * g)) else 0
                        hi += 16 if qh[i] & (1 << (2 * g + 1)) else 0
                    y[64 * g + i] = d * sc1 * lo - dmin * m1
                    y[64 * g + 32 + i] = d * sc2 * hi - dmin * m2
        else:  # Q6_K: ql[128] qh[64] scales[16] (int8) d
            ql, qh, sc, d = blk[0:128], blk[128:192], blk[192:208].view(np.int8), _f16(blk[208:210])
            for h in range(2):
                for i in range(32):
                    is_ = i // 16
                    a, c, hh = int(ql[64 * h + i]), int(ql[64 * h + i + 32]), int(qh[32 * h + i])
                    q1 = ((a & 0xF) | ((hh >> 0) & 3) << 4) - 32
                    q2 = ((c & 0xF) | ((hh >> 2) & 3) << 4) - 32
                    q3 = ((a >> 4) | ((hh >> 4) & 3) << 4) - 32
                    q4 = ((c >> 4) | ((hh >> 6) & 3) << 4) - 32
                    base, s = 128 * h, sc[8 * h :]
                    y[base + i] = d * s[is_] * q1
                    y[base + i + 32] = d * s[is_ + 2] * q2
                    y[base + i + 64] = d * s[is_ + 4] * q3
                    y[base + i + 96] = d * s[is_ + 6] * q4
    return out


def reference_dequantize(raw: np.ndarray, qtype: Q, shape: tuple[int, int]) -> np.ndarray:
    if qtype == Q.F32:
        return raw.view(np.float32).astype(np.float64).reshape(shape)
    if qtype == Q.F16:
        return raw.view(np.float16).astype(np.float64).reshape(shape)
    if qtype == Q.BF16:
        return (
            (raw.view(np.uint16).astype(np.uint32) << 16)
            .view(np.float32)
            .astype(np.float64)
            .reshape(shape)
        )
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    blocks = raw.reshape(-1, size)
    dec = _ref_k(blocks, qtype) if block == 256 else _ref_simple(blocks, qtype)
    return dec.reshape(shape)


def _raw_tensor(qtype: Q, shape, rng) -> tuple[np.ndarray, np.ndarray | None]:
    """(bytes or typed array to write, the float data it approximates or None)."""
    data = rng.standard_normal(shape).astype(np.float32)
    if qtype == Q.F32:
        return data, data
    if qtype in (Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1):
        return gguf.quants.quantize(data, qtype), data
    # K-quants: gguf has no quantizer, so random blocks with sane fp16 scales
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (shape[0], shape[1] // block, size), dtype=np.uint8)
    scales = (
        rng.uniform(0.01, 0.1, (shape[0], shape[1] // block, 2)).astype(np.float16).view(np.uint8)
    )
    if qtype == Q.Q6_K:
        raw[..., 208:210] = scales[..., :2]
    else:
        raw[..., 0:4] = scales.reshape(*scales.shape[:2], 4)
    return raw.reshape(shape[0], -1), None


@pytest.mark.parametrize("sliced", [False, True], ids=["whole", "in-slices-of-rows"])
@pytest.mark.parametrize("name", SUPPORTED_TYPES)
def test_dequantize_matches_reference(name, sliced, tmp_path, monkeypatch):
    if sliced:  # as a vocabulary matrix is dequantized
        monkeypatch.setattr(gguf_loader, "ROWS_AT_A_TIME", 2)
    qtype = Q[name]
    rng = np.random.default_rng(0)
    shape = (3, 512)
    raw, data = _raw_tensor(qtype, shape, rng)
    path = tmp_path / "t.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tensor("x", raw, raw_dtype=None if qtype in (Q.F32, Q.F16) else qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    tensor = gguf.GGUFReader(str(path)).tensors[0]
    assert tensor.tensor_type == qtype
    got = dequantize(tensor)
    assert got.shape == shape and got.dtype == np.float32
    want = reference_dequantize(np.ascontiguousarray(raw).view(np.uint8).reshape(-1), qtype, shape)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    if data is not None:  # and the format round-trips floats within its precision
        tol = {"F32": 0, "F16": 1e-3, "BF16": 1e-2, "Q8_0": 0.03, "Q5_0": 0.2, "Q5_1": 0.2}.get(
            name, 0.4
        )
        assert np.abs(got - data).max() <= tol * np.abs(data).max() + 1e-7


@pytest.mark.parametrize("name", ["Q4_0", "Q4_1"])
def test_4_bit_values_from_the_blocks_are_the_dequantized_ones_bit_for_bit(name):
    """The loader takes a Q4_0 or Q4_1 matrix's float values from the blocks it keeps (faster
    than gguf's dequantization): they must be the very same floats (but the sign of Q4_0's
    zeros: d q + m gives +0 where gguf's d (q - 8) gives -0 for a negative d)."""
    qtype = Q[name]
    raw, _ = _raw_tensor(qtype, (5, 256), np.random.default_rng(1))
    raw = np.ascontiguousarray(raw).view(np.uint8).reshape(-1)
    want = np.asarray(gguf.quants.dequantize(raw, qtype), dtype=np.float32).reshape(5, 256)
    got = int4_blocks(raw, name, (5, 256)).values()
    assert got.dtype == np.float32 and np.array_equal(got, want)
    if name == "Q4_1":
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
    np.testing.assert_allclose(got, reference_dequantize(raw, qtype, (5, 256)), rtol=1e-6)


def test_qk_permutation_matches_llama_cpp_rotary():
    """unpermute(permute(w)) == w, and llama.cpp's interleaved rotary on the permuted rows equals
    HF's rotate-half rotary on the unpermuted ones (so we undo it in the right direction)."""
    from sluice.engine.config import ModelConfig

    heads, d, hidden = 3, 8, 12
    w = torch.randn(heads * d, hidden).numpy()
    p = permute_qk(w, heads)
    assert not np.array_equal(p, w)
    np.testing.assert_array_equal(unpermute_qk(p, heads), w)

    cfg = ModelConfig(
        "llama", 10, hidden, 16, 1, heads, heads, d, 1e-5, 100.0, None, 64, False, False, None, ()
    )
    rot = RotaryEmbedding(cfg)
    x = torch.randn(5, hidden)
    positions = torch.arange(5) * 3
    cos, sin = rot.cos_sin(positions, torch.float32)
    hf_out = apply_rotary((x @ torch.from_numpy(w).T).view(5, heads, d), cos, sin)
    # llama.cpp (GGML_ROPE_TYPE_NORM): rotate adjacent pairs (2i, 2i+1) by angle pos * inv_freq[i]
    y = (x @ torch.from_numpy(p).T).view(5, heads, d // 2, 2)
    c, s = cos[..., None].squeeze(1)[:, None], sin[..., None].squeeze(1)[:, None]
    a, b = y[..., 0], y[..., 1]
    gg = torch.stack((a * c[..., 0] - b * s[..., 0], a * s[..., 0] + b * c[..., 0]), dim=-1).view(
        5, heads, d
    )
    torch.testing.assert_close(
        unpermute_qk(gg.reshape(5, -1).T.numpy(), heads).T,
        hf_out.reshape(5, -1).numpy(),
        rtol=1e-5,
        atol=1e-5,
    )


# ---------------------------------------------------------------- tiny models written as GGUF

_GGUF_LAYER = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    # Qwen3's QK-norm; Phi-3's fused q/k/v and gate/up (the latter under ffn_up)
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "self_attn.qkv_proj": "attn_qkv",
    "mlp.gate_up_proj": "ffn_up",
    # the mixtures of experts' routers and Qwen2-MoE's shared expert
    "mlp.gate": "ffn_gate_inp",
    "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
    "mlp.shared_expert.up_proj": "ffn_up_shexp",
    "mlp.shared_expert.down_proj": "ffn_down_shexp",
    "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
}


# Gemma 3's four norms and QK-norm (its ffn_norm is the MLP input's)
_GGUF_GEMMA3_LAYER = {
    **_GGUF_LAYER,
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}


def write_gguf(
    path,
    hf,
    arch: str,
    rope_freqs: np.ndarray | None = None,
    f16: bool = False,
    override=None,
    extra: dict[str, np.ndarray] | None = None,
):
    """Write a HF model as llama.cpp's converter would (names, Q/K permutation for llama, Gemma's
    norm weights with its 1 added)."""
    c = hf.config
    gemma3 = arch == "gemma3"
    layer_names = _GGUF_GEMMA3_LAYER if gemma3 else _GGUF_LAYER
    w = gguf.GGUFWriter(str(path), arch)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_block_count(c.num_hidden_layers)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    rope = c.rope_parameters["full_attention"] if gemma3 else c.rope_parameters
    w.add_rope_freq_base(rope["rope_theta"])
    w.add_rope_dimension_count(
        getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    )
    if arch in ("gemma3", "qwen3"):
        w.add_key_length(c.head_dim)
        w.add_value_length(c.head_dim)
    if arch in ("gemma3", "phi3") and c.sliding_window:
        w.add_sliding_window(c.sliding_window)
    experts = getattr(c, "num_local_experts", None) or getattr(c, "num_experts", None)
    if experts:
        w.add_expert_count(experts)
        w.add_expert_used_count(c.num_experts_per_tok)
        if hasattr(c, "moe_intermediate_size"):
            w.add_expert_feed_forward_length(c.moe_intermediate_size)
        if getattr(c, "shared_expert_intermediate_size", 0):
            w.add_expert_shared_feed_forward_length(c.shared_expert_intermediate_size)
    w.add_uint32("tokenizer.ggml.eos_token_id", 2)

    def put(gname: str, t: np.ndarray) -> None:
        if override and gname in override:
            t = override[gname](t)
        if isinstance(t, tuple):
            w.add_tensor(gname, t[0], raw_dtype=t[1])
        else:
            w.add_tensor(gname, t.astype(np.float16) if f16 and t.ndim == 2 else t)

    for name, t in hf.state_dict().items():
        t = t.float().numpy()
        if name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        if name.startswith("model.layers."):
            _, _, i, rest = name.split(".", 3)
            module, kind = rest.rsplit(".", 1)
            if module == "mlp.experts":  # transformers' [E, 2I, H] and [E, H, I]
                # llama.cpp stacks a layer's experts' matrices of a kind into one tensor
                if kind == "gate_up_proj":
                    half = t.shape[1] // 2
                    put(f"blk.{i}.ffn_gate_exps.weight", np.ascontiguousarray(t[:, :half]))
                    put(f"blk.{i}.ffn_up_exps.weight", np.ascontiguousarray(t[:, half:]))
                else:
                    put(f"blk.{i}.ffn_down_exps.weight", t)
                continue
            if module.endswith("shared_expert_gate"):
                t = t.reshape(-1)  # (a vector in llama.cpp's files)
            gname = f"blk.{i}.{layer_names[module]}.{kind}"
            if arch == "llama" and module == "self_attn.q_proj":
                t = permute_qk(t, c.num_attention_heads)
            if arch == "llama" and module == "self_attn.k_proj":
                t = permute_qk(t, c.num_key_value_heads)
        else:
            gname = {
                "model.embed_tokens.weight": "token_embd.weight",
                "model.norm.weight": "output_norm.weight",
                "lm_head.weight": "output.weight",
            }[name]
        if gemma3 and name.endswith("norm.weight"):
            t = t + 1.0
        put(gname, t)
    if rope_freqs is not None:
        w.add_tensor("rope_freqs.weight", rope_freqs.astype(np.float32))
    for name, t in (extra or {}).items():
        w.add_tensor(name, t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture
def read_as_floats(monkeypatch) -> list[str]:
    """The HF names of the tensors the loader reads as floats from now on (the rest it reads as
    blocks, or not at all)."""
    names: list[str] = []
    read = gguf_loader._read_tensor

    def spy(t, name, *args):
        names.append(name)
        return read(t, name, *args)

    monkeypatch.setattr(gguf_loader, "_read_tensor", spy)
    return names


def built_as_stored(loaded):
    """The model with int4 weights on the native kernels, from what the file stores as it
    stores it (its blocks, its embedding's rows)."""
    from sluice.engine.kernel_ops import resolve_kernel_ops

    return build_model(
        loaded.config, loaded.tensors, quantization="int4", ops=resolve_kernel_ops("native", "cpu"),
        int4_blocks=loaded.int4_blocks, int8_blocks=loaded.int8_blocks,
        stored_rows=loaded.stored_rows, stored_types=loaded.stored_types,
    )  # fmt: skip


def _check_against_hf(hf, loaded):
    cfg = loaded.config
    model = build_model(cfg, loaded.tensors)
    prompts = make_prompts(cfg.vocab_size)
    ours = run_in_steps(model, prompts, shuffled_tables(LENGTHS, 40), garbage_caches(cfg, 40))
    for got, want in zip(ours, hf_logits(hf, prompts)):
        assert rel_err(got, want) <= 1e-4


def test_tiny_llama_gguf_with_llama3_rope_freqs(tmp_path):
    from sluice.engine.config import ModelConfig
    from sluice.engine.rope import _base_inv_freq, inv_freq_and_scale

    scaling = {
        "rope_type": "llama3",
        "factor": 4.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16,
    }
    hf = build("llama", rope_scaling=scaling)
    # llama.cpp's converter stores llama3 scaling as per-frequency divisors in rope_freqs
    hf_cfg = ModelConfig.from_hf_dict(
        {**hf.config.to_dict(), "architectures": ["LlamaForCausalLM"]}
    )
    factors = (
        _base_inv_freq(hf_cfg.rope_theta, hf_cfg.head_dim) / inv_freq_and_scale(hf_cfg)[0]
    ).numpy()
    path = tmp_path / "tiny.gguf"
    write_gguf(path, hf, "llama", rope_freqs=factors)
    loaded = load_model(path, load_tokenizer=False)
    assert loaded.config.rope_scaling["rope_type"] == "freq_factors"
    assert loaded.config.eos_token_ids == (2,)
    assert not loaded.config.tie_word_embeddings
    _check_against_hf(hf, loaded)


def test_tiny_qwen2_gguf_bias_tied(tmp_path):
    hf = build("qwen2", tie_word_embeddings=True)
    path = tmp_path / "tiny.gguf"
    write_gguf(path, hf, "qwen2")
    loaded = load_model(tmp_path, load_tokenizer=False)  # a directory holding one .gguf file
    assert loaded.config.architecture == "qwen2" and loaded.config.attention_bias
    assert loaded.config.tie_word_embeddings
    _check_against_hf(hf, loaded)


def test_tiny_gemma3_gguf(tmp_path):
    # llama.cpp's defaults for a file that does not say: every 6th layer global, the local
    # layers' theta 10000, queries scaled by head_dim**-0.5
    hf = build(
        "gemma3", num_hidden_layers=7, sliding_window=4, query_pre_attn_scalar=16, head_dim=16
    )
    path = tmp_path / "tiny.gguf"
    write_gguf(path, hf, "gemma3")
    loaded = load_model(path, load_tokenizer=False)
    cfg = loaded.config
    assert cfg.architecture == "gemma3" and cfg.tie_word_embeddings
    assert cfg.layer_windows == (4, 4, 4, 4, 4, None, 4) and cfg.local_rope_theta == 1e4
    # the norms are back in HF's form (the file holds 1 + weight)
    name = "model.layers.0.pre_feedforward_layernorm.weight"
    assert torch.allclose(loaded.tensors[name], hf.state_dict()[name], atol=1e-6)
    _check_against_hf(hf, loaded)


def test_tiny_qwen3_gguf(tmp_path):
    hf = build("qwen3", head_dim=32, attention_bias=True)  # (its o_proj biased too)
    write_gguf(tmp_path / "tiny.gguf", hf, "qwen3")
    loaded = load_model(tmp_path / "tiny.gguf", load_tokenizer=False)
    cfg = loaded.config
    assert cfg.architecture == "qwen3" and cfg.qk_norm and cfg.head_dim == 32 and cfg.o_proj_bias
    _check_against_hf(hf, loaded)


def test_tiny_phi3_gguf_fused_matrices_and_window(tmp_path):
    hf = build("phi3", sliding_window=6)
    write_gguf(tmp_path / "tiny.gguf", hf, "phi3")
    loaded = load_model(tmp_path / "tiny.gguf", load_tokenizer=False)
    cfg = loaded.config
    assert cfg.architecture == "phi3" and cfg.sliding_window == 6
    # the fused matrices' parts under HF's names, the fused names gone
    assert "model.layers.0.mlp.up_proj.weight" in loaded.tensors
    assert "model.layers.0.mlp.gate_up_proj.weight" not in loaded.tensors
    _check_against_hf(hf, loaded)


@pytest.mark.parametrize(
    "kind,arch,overrides",
    [
        ("mixtral", "llama", {}),  # (Q and K rows permuted, as llama.cpp stores Llama's)
        ("qwen2_moe", "qwen2moe", {"num_hidden_layers": 3, "mlp_only_layers": [1]}),
        ("qwen3_moe", "qwen3moe", {}),
        ("olmoe", "olmoe", {}),
    ],
)
def test_tiny_mixture_of_experts_gguf(kind, arch, overrides, tmp_path):
    """llama.cpp's form of a mixture of experts: each layer's experts stacked into one tensor per
    kind of matrix, the router as ffn_gate_inp, Qwen2-MoE's shared expert and its vector gate; a
    layer without a router is dense."""
    hf = build(kind, **overrides)
    write_gguf(tmp_path / "tiny.gguf", hf, arch)
    loaded = load_model(tmp_path / "tiny.gguf", load_tokenizer=False)
    cfg = loaded.config
    assert cfg.architecture == kind and (cfg.num_experts, cfg.num_experts_per_tok) == (4, 2)
    assert cfg.dense_layers == tuple(overrides.get("mlp_only_layers", ()))
    assert cfg.norm_topk_prob == (kind in ("mixtral", "qwen3_moe"))
    _check_against_hf(hf, loaded)


def test_quantized_experts_keep_their_stored_blocks(tmp_path, read_as_floats):
    """A Qwen2-MoE file whose stacked experts are 4-bit (gate, up) and Q8_0 (down) blocks, its
    shared expert Q4_1: with int4 weights each expert's matrices hold the file's values of that
    expert (float64 reference decoder), none of them read as floats; `--quantization auto` runs
    it so."""
    from sluice.engine.cpu_kernels.block_int8_linear import FMT_Q4, FMT_Q8, widen_blocks

    rng = np.random.default_rng(4)
    hf = build(
        "qwen2_moe", hidden_size=256, moe_intermediate_size=256, shared_expert_intermediate_size=64
    )
    c = hf.config
    raws: dict[str, tuple[np.ndarray, Q]] = {}

    def stored(gguf_name: str, qtype: Q):
        def raw_of(t):
            rows = t.reshape(-1, t.shape[-1])
            raw = _raw_tensor(qtype, rows.shape, rng)[0]
            raws[gguf_name] = raw, qtype
            return raw.reshape(*t.shape[:-1], -1), qtype

        return raw_of

    kinds = {
        "ffn_gate_exps": Q.Q4_0,
        "ffn_up_exps": Q.Q4_0,
        "ffn_down_exps": Q.Q8_0,
        "ffn_gate_shexp": Q.Q4_1,
        "ffn_up_shexp": Q.Q4_1,
        "ffn_down_shexp": Q.Q4_1,
    }
    override = {
        f"blk.{i}.{kind}.weight": stored(f"blk.{i}.{kind}.weight", qtype)
        for i in range(c.num_hidden_layers)
        for kind, qtype in kinds.items()
    }
    write_gguf(tmp_path / "m.gguf", hf, "qwen2moe", override=override)
    loaded = load_model(tmp_path / "m.gguf", load_tokenizer=False)
    assert loaded.stored_formats == ("Q4_0", "Q4_1", "Q8_0")
    model = built_as_stored(loaded)
    assert not [n for n in read_as_floats if "expert" in n and n.endswith("_proj.weight")]

    def file_values(gguf_name: str, expert: int | None, rows: int) -> np.ndarray:
        raw, qtype = raws[gguf_name]
        per = raw.reshape(-1, raw.shape[-1]).shape[0] // (
            c.num_experts if expert is not None else 1
        )
        raw = raw.reshape(-1, raw.shape[-1])[(expert or 0) * per : ((expert or 0) + 1) * per]
        flat = np.ascontiguousarray(raw).view(np.uint8).reshape(-1)
        return reference_dequantize(flat, qtype, (rows, 256))

    for i, layer in enumerate(model.layers):
        moe = layer.experts
        for e in range(c.num_experts):
            want = np.concatenate(
                [file_values(f"blk.{i}.ffn_{k}_exps.weight", e, 256) for k in ("gate", "up")]
            )
            got = moe.gate_up[e]
            assert got.packed.fmt == FMT_Q4
            values = widen_blocks(got.packed, torch.float32).double().numpy()
            assert np.abs(values - want).max() <= 1e-6 * np.abs(want).max(), (i, e)
            down = moe.down[e]
            assert down.packed.fmt == FMT_Q8  # (stored wider than 4 bits: int8, its own codes)
            values = widen_blocks(down.packed, torch.float32).double().numpy()
            want = file_values(f"blk.{i}.ffn_down_exps.weight", e, 256)
            assert np.abs(values - want).max() <= 1e-6 * np.abs(want).max(), (i, e)
        assert moe.shared_down.packed.fmt == FMT_Q4
    config = EngineConfig(quantization="auto", kv_cache_bytes=1 << 20)
    assert LLMEngine(config=config, loaded=loaded).config.quantization == "int4"


def test_phi3_longrope_file_is_refused(tmp_path):
    """llama.cpp's LongRoPE factors (Phi-3's 128k files): refused, not silently run without."""
    factors = {"rope_factors_long.weight": np.ones(8, dtype=np.float32)}
    write_gguf(tmp_path / "m.gguf", build("phi3"), "phi3", extra=factors)
    with pytest.raises(ModelError) as e:
        load_model(tmp_path / "m.gguf", load_tokenizer=False)
    assert e.value.field == "rope_factors_long.weight" and "LongRoPE" in str(e.value)


def test_phi3_fused_matrices_keep_their_stored_blocks(tmp_path, read_as_floats):
    """A Phi-3 file whose fused q/k/v and gate/up matrices are 4-bit blocks: with int4 weights
    each layer's qkv and gate_up hold the file's values of the fused matrix (float64 reference
    decoder), none of them read as floats; the Q8_0 ones are int8 blocks with the file's codes."""
    from sluice.engine.cpu_kernels.block_int8_linear import FMT_Q4, FMT_Q8, widen_blocks

    rng = np.random.default_rng(3)
    hf = build("phi3", hidden_size=256, intermediate_size=256)
    layers = hf.config.num_hidden_layers
    raws: dict[str, tuple[np.ndarray, Q]] = {}

    def stored(gguf_name: str, qtype: Q):
        def raw_of(t):
            raws[gguf_name] = _raw_tensor(qtype, t.shape, rng)[0], qtype
            return raws[gguf_name]

        return raw_of

    kinds = {"attn_qkv": Q.Q4_0, "ffn_up": Q.Q4_1, "attn_output": Q.Q8_0, "ffn_down": Q.Q4_0}
    override = {
        f"blk.{i}.{kind}.weight": stored(f"blk.{i}.{kind}.weight", qtype)
        for i in range(layers)
        for kind, qtype in kinds.items()
    }
    write_gguf(tmp_path / "m.gguf", hf, "phi3", override=override)
    loaded = load_model(tmp_path / "m.gguf", load_tokenizer=False)
    model = built_as_stored(loaded)
    assert not [n for n in read_as_floats if "layers" in n and not n.endswith("norm.weight")]
    for i, layer in enumerate(model.layers):
        for module, kind in ((layer.qkv, "attn_qkv"), (layer.gate_up, "ffn_up"),
                             (layer.o_proj, "attn_output"), (layer.down, "ffn_down")):  # fmt: skip
            raw, qtype = raws[f"blk.{i}.{kind}.weight"]
            flat = np.ascontiguousarray(raw).view(np.uint8).reshape(-1)
            rows = module.packed.n
            want = reference_dequantize(flat, qtype, (rows, 256))
            got = widen_blocks(module.packed, torch.float32).double().numpy()
            assert module.packed.fmt == (FMT_Q8 if qtype == Q.Q8_0 else FMT_Q4)
            assert np.abs(got - want).max() <= 1e-6 * np.abs(want).max(), (i, kind)


def test_f16_gguf_equals_rounded_weights(tmp_path):
    hf = build("llama")
    write_gguf(tmp_path / "m.gguf", hf, "llama", f16=True)
    loaded = load_model(tmp_path / "m.gguf", load_tokenizer=False)
    t = hf.state_dict()["model.layers.0.mlp.up_proj.weight"]
    assert torch.equal(loaded.tensors["model.layers.0.mlp.up_proj.weight"], t.half().float())


# ---------------------------------------------------------------- the default model


@pytest.fixture(scope="module")
def smollm2():
    return load_model(None)


def test_default_model_metadata(smollm2):
    c = smollm2.config
    assert (c.architecture, c.num_hidden_layers, c.hidden_size, c.intermediate_size) == (
        "llama",
        30,
        576,
        1536,
    )
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.vocab_size) == (
        9,
        3,
        64,
        49152,
    )
    assert c.tie_word_embeddings and c.rope_theta == 100000.0 and c.max_position_embeddings == 8192
    from sluice.engine.loader.default import default_model_path

    assert smollm2.source == str(default_model_path()) and smollm2.source.endswith(".gguf")
    assert smollm2.tokenizer is not None and 2 in c.eos_token_ids


def test_the_file_says_how_it_stored_its_layers_and_the_engine_suggests_running_them_so(
    smollm2, tmp_path, caplog
):
    """The default file keeps its layers in Q4_1 (its embedding, Q8_0, is not a layer's); a float
    file reports nothing. An engine that runs quantized layers dequantized says which
    --quantization multiplies them as stored; asked for it, it says nothing."""
    import logging

    from sluice.engine.config import EngineConfig
    from sluice.engine.engine import LLMEngine

    assert smollm2.stored_formats == ("Q4_1",)
    write_gguf(tmp_path / "m.gguf", build("llama"), "llama", f16=True)
    assert load_model(tmp_path / "m.gguf", load_tokenizer=False).stored_formats == ()

    def hint(**config) -> list[str]:
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="sluice.engine.engine"):
            LLMEngine(config=EngineConfig(kv_cache_bytes=8 << 20, **config))
        return [r.getMessage() for r in caplog.records if "multiplies them quantized" in r.message]

    (line,) = hint(kernels="native")
    assert "as Q4_1" in line and "--quantization int4" in line and "float32" in line
    assert hint(kernels="native", quantization="int4") == []


def test_quantization_auto_runs_a_files_layers_as_it_stores_them(smollm2, tmp_path, caplog):
    """`quantization="auto"` (the CLI's default): the default file's Q4_1 layers run as 4-bit
    blocks on the native kernels, the same engine `--quantization int4` builds; a float file, or
    kernels that multiply no quantized blocks, run unquantized. The start log says which and
    why."""
    import logging

    from sluice.engine.config import EngineConfig
    from sluice.engine.cpu_kernels.block_int8_linear import FMT_Q4, FMT_Q8
    from sluice.engine.engine import LLMEngine
    from sluice.engine.sampling_params import SamplingParams

    def engine(loaded=None, **config) -> tuple[LLMEngine, str]:
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="sluice.engine.engine"):
            built = LLMEngine(config=EngineConfig(kv_cache_bytes=8 << 20, **config), loaded=loaded)
        said = [r.getMessage() for r in caplog.records if "quantization auto" in r.message]
        return built, " ".join(said)

    auto, said = engine(kernels="native", quantization="auto")
    assert auto.config.quantization == "int4" and "int4 (" in said and "Q4_1" in said
    layer = auto.runner.model.layers[0]
    assert layer.qkv.packed.fmt == FMT_Q4 and layer.down.packed.fmt == FMT_Q4
    assert auto.runner.model.lm_head.packed.fmt == FMT_Q8  # the head stays int8, as stored
    assert auto.provenance.quantization == "int4"
    explicit, _ = engine(kernels="native", quantization="int4")
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompt = ["The capital of France is"]
    tokens = [e.generate(prompt, params)[0].token_ids for e in (auto, explicit)]
    assert tokens[0] == tokens[1]

    torch_kernels, said = engine(kernels="torch", quantization="auto")
    assert torch_kernels.config.quantization is None and "torch kernels" in said
    write_gguf(tmp_path / "m.gguf", build("llama"), "llama", f16=True)
    loaded = load_model(tmp_path / "m.gguf", load_tokenizer=False)
    floats, said = engine(loaded, kernels="native", quantization="auto")
    assert floats.config.quantization is None and "as floats" in said


def test_auto_picks_int4_wherever_a_file_has_4_bit_layers():
    """A file with 4-bit layers runs int4 (its wider matrices int8: the next test), one with
    only wider types int8, a float file unquantized."""
    from sluice.engine.kernel_ops import resolve_kernel_ops
    from sluice.engine.stored_quantization import quantization_as_stored

    native = resolve_kernel_ops("native", "cpu")
    assert quantization_as_stored(("Q4_0", "Q4_K"), native).quantization == "int4"
    mixed = quantization_as_stored(("Q4_K", "Q6_K"), native)
    assert mixed.quantization == "int4" and "Q6_K matrices keep their blocks" in mixed.reason
    assert quantization_as_stored(("Q6_K", "Q8_0"), native).quantization == "int8"
    assert quantization_as_stored((), native).quantization is None


def stored_llama(tmp_path, type_of, seed: int, extra=None):
    """A tiny llama GGUF whose layer matrices are stored as `type_of(part)` (a HF part name, as
    PROJECTION_PARTS lists them; K-quants as random blocks) and whose `extra` tensors (GGUF name
    -> (HF name, type)) likewise, loaded. Returns (the HF model, the loaded file, file_matrix):
    file_matrix(hf_name) is a stored matrix's values as the float64 reference decoder reads its
    bytes, in HF's row order (llama's q and k rows back from the file's rotary order)."""
    from sluice.engine.loader.tensor_names import PROJECTION_PARTS

    rng = np.random.default_rng(seed)
    hf = build("llama", hidden_size=256, intermediate_size=256)
    raws: dict[str, tuple[np.ndarray, Q]] = {}  # by HF name

    def stored(hf_name: str, qtype: Q):
        def raw_of(t):
            raws[hf_name] = _raw_tensor(qtype, t.shape, rng)[0], qtype
            return raws[hf_name]

        return raw_of

    override = {
        f"blk.{i}.{_GGUF_LAYER[part]}.weight": stored(
            f"model.layers.{i}.{part}.weight", type_of(part)
        )
        for i in range(hf.config.num_hidden_layers)
        for parts in PROJECTION_PARTS.values()
        for part in parts
    }
    for gguf_name, (hf_name, qtype) in (extra or {}).items():
        override[gguf_name] = stored(hf_name, qtype)
    write_gguf(tmp_path / "m.gguf", hf, "llama", override=override)
    loaded = load_model(tmp_path / "m.gguf", load_tokenizer=False)
    c = loaded.config

    def file_matrix(hf_name: str) -> np.ndarray:
        raw, qtype = raws[hf_name]
        flat = np.ascontiguousarray(raw).view(np.uint8).reshape(-1)
        w = reference_dequantize(flat, qtype, tuple(loaded.tensors[hf_name].shape))
        if "q_proj" in hf_name:
            w = unpermute_qk(w, c.num_attention_heads)
        elif "k_proj" in hf_name:
            w = unpermute_qk(w, c.num_key_value_heads)
        return w

    return hf, loaded, file_matrix


def test_a_mixed_file_keeps_its_wider_matrices_wider(tmp_path, read_as_floats):
    """A Q4_K_M-like file (Q4_K, with the V projection and the down projection in Q6_K, as
    llama.cpp's mixed files keep their most sensitive matrices wider, and Q8_0 vocabulary
    matrices): with int4 weights the projections stored in 4 bits hold the file's blocks, the
    down projection (all Q6_K) holds the file's Q6_K blocks, values exactly the file's (float64
    reference decoder), and the fused q/k/v, a Q6_K matrix beside Q4_K ones, is int8 blocks within
    half an int8 step (and its float16 rounding) of the file's values; the LM head holds the
    file's own codes and the embedding's rows are read from the file's blocks (`FileEmbedding`).
    No matrix is read as floats on the way (only the norms are)."""
    from sluice.engine.cpu_kernels.block_int8_linear import FMT_Q4, FMT_Q6, FMT_Q8, widen_blocks

    wide = ("self_attn.v_proj", "mlp.down_proj")
    vocabulary = {
        "token_embd.weight": ("model.embed_tokens.weight", Q.Q8_0),
        "output.weight": ("lm_head.weight", Q.Q8_0),
    }
    hf, loaded, file_matrix = stored_llama(
        tmp_path, lambda part: Q.Q6_K if part in wide else Q.Q4_K, 2, vocabulary
    )
    assert loaded.stored_formats == ("Q4_K", "Q6_K") and not loaded.config.tie_word_embeddings
    model = built_as_stored(loaded)
    assert read_as_floats and all(name.endswith("norm.weight") for name in read_as_floats)
    head = widen_blocks(model.lm_head.packed, torch.float32).double().numpy()
    assert np.array_equal(head, file_matrix("lm_head.weight"))
    rows = model.embed_tokens(torch.arange(hf.config.vocab_size)).double().numpy()
    assert np.array_equal(rows, file_matrix("model.embed_tokens.weight"))
    for i, layer in enumerate(model.layers):
        assert layer.o_proj.packed.fmt == FMT_Q4 and layer.gate_up.packed.fmt == FMT_Q4
        assert layer.qkv.packed.fmt == FMT_Q8 and layer.down.packed.fmt == FMT_Q6
        down = widen_blocks(layer.down.packed, torch.float32).double().numpy()
        assert np.array_equal(down, file_matrix(f"model.layers.{i}.mlp.down_proj.weight"))
        attn = f"model.layers.{i}.self_attn"
        want = np.concatenate([file_matrix(f"{attn}.{p}_proj.weight") for p in "qkv"])
        got = widen_blocks(layer.qkv.packed, torch.float32).double().numpy()
        step = np.repeat(np.abs(want).reshape(len(want), -1, 32).max(axis=2) / 127, 32, axis=1)
        # half a step, and the step's float16 rounding times up to 127 (a zero block: exact)
        assert (np.abs(got - want) <= step * (0.5 + 127 * 2**-11)).all()


def test_default_model_logits_match_transformers_gguf_loader(smollm2, monkeypatch):
    """transformers' GGUF path (what from_pretrained(dir, gguf_file=...) runs; from_pretrained
    itself also wants accelerate) dequantizes the same bytes with the same numpy code, so the
    weights are identical and only float32 summation order differs: 1e-4 of the largest logit is
    ample."""
    import functools

    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    # Speed only: read the file once for both calls, and memoize gguf's name map, which
    # transformers rebuilds for each of its ~400 submodules (6 s otherwise).
    reader = gguf.GGUFReader(smollm2.source)
    monkeypatch.setattr(gguf, "GGUFReader", lambda *a, **k: reader)
    monkeypatch.setattr(gguf, "get_tensor_name_map", functools.lru_cache(gguf.get_tensor_name_map))
    meta = load_gguf_checkpoint(smollm2.source, return_tensors=False)["config"]
    hf_cfg = LlamaConfig(
        **{k: v for k, v in meta.items() if not k.startswith("_") and k != "model_type"}
    )
    with torch.device("meta"):
        hf = LlamaForCausalLM(hf_cfg)
    sd = load_gguf_checkpoint(smollm2.source, return_tensors=True, model_to_load=hf)["tensors"]
    sd["lm_head.weight"] = sd["model.embed_tokens.weight"]
    hf.load_state_dict(sd, assign=True, strict=False)
    hf.model.rotary_emb.__init__(hf_cfg)  # buffers were created on the meta device
    hf.float().eval()

    tok = smollm2.tokenizer
    prompts = [
        tok.encode(
            "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
        ),
        tok.encode("The quick brown fox jumps over the lazy dog. " * 3),
    ]
    model = build_model(smollm2.config, smollm2.tensors)
    cfg = smollm2.config
    caches = garbage_caches(cfg, 16)
    tables = shuffled_tables([len(p) for p in prompts], 16)
    plan = plan_for(model, caches, [len(p) for p in prompts], [len(p) for p in prompts], tables)
    ids = torch.tensor(prompts[0] + prompts[1])
    hidden = model(ids, plan, caches)
    last = torch.tensor([len(prompts[0]) - 1, len(ids) - 1])
    ours = model.compute_logits(hidden[last])
    with torch.no_grad():
        for i, p in enumerate(prompts):
            want = hf(torch.tensor([p])).logits[0, -1]
            assert rel_err(ours[i], want) <= 1e-4
            assert ours[i].argmax() == want.argmax()


# ---------------------------------------------------------------- the Gemma 3 270M file

# "<bos>The capital of France is" by the file's own (SentencePiece) tokenizer
GEMMA3_PROMPT = [2, 818, 5279, 529, 7001, 563]
GEMMA3_NEW_TOKENS = 16


@pytest.mark.slow
def test_gemma3_270m_greedy_tokens_match_transformers_gguf_loader(monkeypatch):
    """The file as the engine runs it (Q5_0, Q4_K, Q6_K, Q8_0 dequantized to float32) and as
    transformers loads it (the same numpy dequantization): the same 16 greedy tokens in float32,
    on the torch family and on the CPU default."""
    import dataclasses
    import functools

    from sluice.engine.config import EngineConfig
    from sluice.engine.engine import LLMEngine
    from sluice.engine.loader import catalog
    from sluice.engine.loader.gguf import open_gguf
    from sluice.engine.sampling_params import SamplingParams

    try:
        path = catalog.locate("gemma3-270m")
    except EngineError as e:
        pytest.skip(f"the Gemma 3 270M file is not installed (sluice models pull gemma3-270m): {e}")
    loaded = load_model(path, load_tokenizer=False)
    assert loaded.config.architecture == "gemma3"
    params = SamplingParams(temperature=0, max_tokens=GEMMA3_NEW_TOKENS, ignore_eos=True)
    ours = {}
    for kernels in ("torch", "auto"):
        # (an engine empties the dict it was given once its model holds the weights)
        mine = dataclasses.replace(loaded, tensors=dict(loaded.tensors))
        e = LLMEngine(config=EngineConfig(kernels=kernels, kv_cache_bytes=64 << 20), loaded=mine)
        ours[kernels] = e.generate(prompt_token_ids=[GEMMA3_PROMPT], params=params)[0].token_ids
    pieces = open_gguf(path).fields["tokenizer.ggml.tokens"]
    text = "".join(pieces[t] for t in ours["torch"]).replace("\u2581", " ")
    assert "France" in text, text  # sensible: it goes on about France

    # Speed only: gguf's name map, which transformers rebuilds for each submodule
    monkeypatch.setattr(gguf, "get_tensor_name_map", functools.lru_cache(gguf.get_tensor_name_map))
    hf = reference_model(path, torch.float32)
    with torch.no_grad():
        out = hf.generate(
            torch.tensor([GEMMA3_PROMPT]), max_new_tokens=GEMMA3_NEW_TOKENS, do_sample=False
        )
    theirs = out[0, len(GEMMA3_PROMPT) :].tolist()
    assert ours["torch"] == theirs and ours["auto"] == theirs


# ---------------------------------------------------------------- errors


def test_unsupported_quant_type(tmp_path):
    hf = build(
        "llama",
        intermediate_size=256,
        hidden_size=256,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    rng = np.random.default_rng(0)

    def q2k(t):
        return (
            rng.integers(0, 256, (t.shape[0], t.shape[1] // 256 * 84), dtype=np.uint8),
            Q.Q2_K,
        )

    path = tmp_path / "q2k.gguf"
    write_gguf(path, hf, "llama", override={"blk.1.ffn_up.weight": q2k})
    with pytest.raises(EngineError) as e:
        load_model(path, load_tokenizer=False)
    msg = str(e.value)
    assert str(path) in msg and "blk.1.ffn_up.weight" in msg and "Q2_K" in msg
    assert e.value.field == "blk.1.ffn_up.weight"


def test_unknown_gguf_architecture(tmp_path):
    path = tmp_path / "gpt2.gguf"
    w = gguf.GGUFWriter(str(path), "gpt2")
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(EngineError) as e:
        load_model(path, load_tokenizer=False)
    assert (
        str(path) in str(e.value)
        and "'gpt2'" in str(e.value)
        and e.value.field == "general.architecture"
    )


def test_gguf_missing_and_misshapen_tensor(tmp_path):
    hf = build("llama")
    path = tmp_path / "bad.gguf"
    write_gguf(path, hf, "llama", override={"blk.0.ffn_down.weight": lambda t: t[:, :-1].copy()})
    with pytest.raises(EngineError) as e:
        load_model(path, load_tokenizer=False)
    msg = str(e.value)
    assert (
        str(path) in msg
        and "model.layers.0.mlp.down_proj.weight" in msg
        and "[64, 95]" in msg
        and "[64, 96]" in msg
    )


def test_the_cli_runs_a_file_as_stored_unless_told_none():
    import argparse

    from sluice.cli.generate import add_engine_arguments, engine_config_from_args

    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)

    def quantization(*flags: str) -> str | None:
        return engine_config_from_args(parser.parse_args(list(flags))).quantization

    assert quantization() == "auto"
    assert quantization("--quantization", "none") is None
    assert quantization("--quantization", "int8") == "int8"


@pytest.mark.parametrize("name", ["Q5_0", "Q5_1", "Q5_K"])
def test_5_bit_matrices_keep_the_files_own_blocks(name, tmp_path, read_as_floats):
    """A llama GGUF whose layer matrices are stored as `name` (Q5_K_M files' type, and Gemma's
    Q5_0): each projection holds the file's 5-bit blocks (`FMT_Q5`, never read as floats), their
    values the float64 reference decoder's: exactly for Q5_0 and Q5_1, and for Q5_K within
    float16 rounding of each block's d sc and dmin mn, as Q4_K's."""
    from sluice.engine.cpu_kernels.block_int8_linear import FMT_Q5, widen_blocks
    from sluice.engine.loader.gguf_blocks import stacked
    from sluice.engine.loader.tensor_names import PROJECTION_PARTS

    _, loaded, file_matrix = stored_llama(tmp_path, lambda part: Q[name], 4)
    model = built_as_stored(loaded)
    assert all(not name.startswith("model.layers.") or name.endswith("norm.weight")
               for name in read_as_floats)  # fmt: skip
    for i, layer in enumerate(model.layers):
        for projection, parts in PROJECTION_PARTS.items():
            names = [f"model.layers.{i}.{part}.weight" for part in parts]
            want = np.concatenate([file_matrix(n) for n in names])
            packed = getattr(layer, projection).packed
            assert packed.fmt == FMT_Q5, (projection, packed.fmt)
            err = np.abs(widen_blocks(packed, torch.float32).double().numpy() - want)
            if name == "Q5_K":
                blocks = stacked([loaded.int8_blocks[n] for n in names])
                d, m = (
                    np.repeat(t.double().abs().numpy(), 32, axis=1) for t in (blocks.d, blocks.m)
                )
                assert (err <= (31 * d + m) * 2**-11 + 1e-6 * np.abs(want).max()).all()
            else:
                assert err.max() == 0, err.max()


@pytest.mark.parametrize("name", ["Q4_0", "Q4_1", "Q4_K"])
def test_int4_weights_keep_the_files_own_4_bit_blocks(name, tmp_path):
    """A llama GGUF whose layer matrices are stored as `name`: with int4 weights each projection
    holds the file's values (decoded by the float64 reference decoders above from the bytes, Q/K
    rows unpermuted, fused in order): exactly for Q4_0 and Q4_1, and for Q4_K within float16
    rounding of each block's d sc and dmin mn (products, so not float16 themselves). Quantizing
    the values again, as a matrix without stored blocks is, puts Q4_0's and Q4_K's blocks on other
    grids: further from the file."""
    from sluice.engine.cpu_kernels.block_int8_linear import widen_blocks
    from sluice.engine.kernel_ops import resolve_kernel_ops
    from sluice.engine.loader.gguf_blocks import Int4Blocks
    from sluice.engine.loader.tensor_names import PROJECTION_PARTS
    from sluice.engine.weights import BlockInt8Linear, Linear

    hf, loaded, file_matrix = stored_llama(tmp_path, lambda part: Q[name], 1)
    layers = hf.config.num_hidden_layers
    assert loaded.stored_formats == (name,) and len(loaded.int4_blocks) == 7 * layers
    model = build_model(
        loaded.config, loaded.tensors, quantization="int4", ops=resolve_kernel_ops("native", "cpu"),
        int4_blocks=loaded.int4_blocks,
    )  # fmt: skip
    for i, layer in enumerate(model.layers):
        for projection, parts in PROJECTION_PARTS.items():
            names = [f"model.layers.{i}.{part}.weight" for part in parts]
            want = np.concatenate([file_matrix(n) for n in names])
            module = getattr(layer, projection)
            err = np.abs(widen_blocks(module.packed, torch.float32).double().numpy() - want)
            float32_part = 1e-6 * np.abs(want).max()
            if name == "Q4_K":
                blocks = Int4Blocks.concat([loaded.int4_blocks[n] for n in names])
                d, m = (
                    np.repeat(t.double().abs().numpy(), 32, axis=1) for t in (blocks.d, blocks.m)
                )
                assert (err <= (15 * d + m) * 2**-11 + float32_part).all(), err.max()
            else:
                assert err.max() <= float32_part, err.max()
            again = BlockInt8Linear.quantize(Linear(torch.from_numpy(want).float()), 4)
            redone = np.abs(widen_blocks(again.packed, torch.float32).double().numpy() - want)
            if name != "Q4_1":  # (llama.cpp's Q4_1 blocks span 0..15: found again exactly)
                assert redone.max() > 4 * err.max()
