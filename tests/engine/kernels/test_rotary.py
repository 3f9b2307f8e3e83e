"""rotary in place: Triton kernel vs torch reference vs the engine's `apply_rotary` and float64,
with llama3-scaled angles at large positions (interpreter on the CPU)."""

from __future__ import annotations

import pytest
import torch
from _tolerances import U, assert_kernel_matches

from sluice.engine.config import ModelConfig
from sluice.engine.kernels import rotary
from sluice.engine.rope import RotaryEmbedding, apply_rotary

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def _config(hq, hkv, d, scaling=LLAMA3_SCALING):
    return ModelConfig.from_hf_dict(
        {
            "architectures": ["LlamaForCausalLM"],
            "vocab_size": 100,
            "hidden_size": hq * d,
            "head_dim": d,
            "intermediate_size": 64,
            "num_hidden_layers": 1,
            "num_attention_heads": hq,
            "num_key_value_heads": hkv,
            "rope_theta": 500000.0,
            "rope_scaling": scaling,
            "max_position_embeddings": 131072,
        }
    )


def _cos_sin(cfg, positions):
    cos, sin = RotaryEmbedding(cfg).cos_sin(positions, torch.float32)
    return cos.squeeze(1).to(DEVICE), sin.squeeze(1).to(DEVICE)


def _fused_qkv(T, hq, hkv, d, dtype, seed, pad=24):
    """[T, (hq + 2*hkv)*d + pad] with q, k, v column views: token stride is not (hq + 2*hkv)*d."""
    g = torch.Generator().manual_seed(seed)
    m = (torch.randn(T, (hq + 2 * hkv) * d + pad, generator=g) * 2).to(dtype).to(DEVICE)
    return m


def _views(m, hq, hkv, d):
    T = m.shape[0]
    q = m[:, : hq * d].view(T, hq, d)
    k = m[:, hq * d : (hq + hkv) * d].view(T, hkv, d)
    return q, k


def _float64_rotate(x, cos, sin):
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].double(), x[..., half:].double()
    c, s = cos.double()[:, None], sin.double()[:, None]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("T,hq,hkv,d", [(7, 9, 3, 64), (1, 4, 4, 32), (13, 6, 2, 80)])
def test_rotary_on_fused_qkv_views(T, hq, hkv, d, dtype):
    cfg = _config(hq, hkv, d)
    g = torch.Generator().manual_seed(T + d)
    positions = torch.randint(0, 120_000, (T,), generator=g)
    positions[0] = 0  # identity rotation for the first token
    cos, sin = _cos_sin(cfg, positions)
    orig = _fused_qkv(T, hq, hkv, d, dtype, seed=T * 31 + d)

    ref_m, got_m = orig.clone(), orig.clone()
    rotary.rotary_torch_(*_views(ref_m, hq, hkv, d), cos, sin)
    rotary.rotary_triton_(*_views(got_m, hq, hkv, d), cos, sin)

    # v and the padding columns are untouched, bit for bit
    for m in (ref_m, got_m):
        assert torch.equal(m[:, (hq + hkv) * d :], orig[:, (hq + hkv) * d :])
    q0, k0 = _views(orig, hq, hkv, d)
    rq, rk = _views(ref_m, hq, hkv, d)
    # the reference against float64 math on the same angles: one rounding to the dtype
    torch.testing.assert_close(
        rq.double(), _float64_rotate(q0, cos, sin), rtol=U[dtype] + 1e-6, atol=1e-5
    )
    torch.testing.assert_close(
        rk.double(), _float64_rotate(k0, cos, sin), rtol=U[dtype] + 1e-6, atol=1e-5
    )
    # position 0: cos 1, sin 0
    assert torch.equal(rq[0], q0[0]) and torch.equal(rk[0], k0[0])
    assert_kernel_matches(got_m, ref_m, dtype, atol=1e-5)


@pytest.mark.parametrize("scaling", [LLAMA3_SCALING, None])
def test_matches_engine_apply_rotary_float32(scaling):
    """Independent check against the engine's CPU rotary path, contiguous q and k,
    cos/sin given in `cos_sin`'s own [T, 1, D/2] shape."""
    T, hq, hkv, d = 6, 4, 2, 64
    cfg = _config(hq, hkv, d, scaling)
    positions = torch.tensor([0, 1, 8191, 8192, 65_000, 131_071])
    cos3, sin3 = RotaryEmbedding(cfg).cos_sin(positions, torch.float32)
    g = torch.Generator().manual_seed(5)
    q0 = torch.randn(T, hq, d, generator=g)
    k0 = torch.randn(T, hkv, d, generator=g)
    want_q, want_k = apply_rotary(q0, cos3, sin3), apply_rotary(k0, cos3, sin3)
    cos3, sin3 = cos3.to(DEVICE), sin3.to(DEVICE)
    for fn in (rotary.rotary_torch_, rotary.rotary_triton_):
        q, k = q0.clone().to(DEVICE), k0.clone().to(DEVICE)
        fn(q, k, cos3, sin3)
        torch.testing.assert_close(q.cpu(), want_q, rtol=1e-6, atol=1e-5)
        torch.testing.assert_close(k.cpu(), want_k, rtol=1e-6, atol=1e-5)
    # llama3 scaling changes the low frequencies: the scaled angles really differ from plain ones
    if scaling is not None:
        plain_cos, _ = RotaryEmbedding(_config(hq, hkv, d, None)).cos_sin(positions, torch.float32)
        assert not torch.allclose(plain_cos.to(DEVICE), cos3)


def test_bad_shapes_raise():
    q = torch.zeros(3, 2, 8, device=DEVICE)
    with pytest.raises(ValueError):
        rotary.rotary_triton_(
            q, q, torch.zeros(3, 3, device=DEVICE), torch.zeros(3, 3, device=DEVICE)
        )
