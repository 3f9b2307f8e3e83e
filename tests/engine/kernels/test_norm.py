"""add_rmsnorm: Triton kernel vs torch reference vs a float64 computation (interpreter on the
CPU)."""

from __future__ import annotations

import pytest
import torch
from _tolerances import U, assert_kernel_matches

from sluice.engine.kernel_ops.torch_ops import TorchOps
from sluice.engine.kernels import norm

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
EPS = 1e-5


def _inputs(T, H, dtype, seed, weight_dtype=None):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(T, H, generator=g) * 3).to(dtype)
    res = torch.randn(T, H, generator=g).to(dtype)
    w = (1 + 0.5 * torch.randn(H, generator=g)).to(weight_dtype or dtype)
    return x.to(DEVICE), res.to(DEVICE), w.to(DEVICE)


def _float64_rmsnorm(r, w):
    """Independent float64 computation; the only rounding mirrored is HF's cast to the model dtype
    before the weight multiply, which costs one rounding (covered by the tolerance below)."""
    r64 = r.double()
    return w.double() * (r64 * torch.rsqrt(r64.pow(2).mean(-1, keepdim=True) + EPS))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("H", [576, 64, 2048])
@pytest.mark.parametrize("T", [1, 7, 33])
def test_add_rmsnorm_matches_reference(T, H, dtype):
    x, res, w = _inputs(T, H, dtype, seed=T * 1000 + H)
    ref_n, ref_r = norm.add_rmsnorm_torch(x, res, w, EPS)
    # the reference: residual sum rounded like a plain add; normed within two roundings of float64
    assert torch.equal(ref_r, x + res)
    torch.testing.assert_close(
        ref_n.double(), _float64_rmsnorm(ref_r, w), rtol=2.01 * U[dtype] + 1e-6, atol=1e-6
    )
    # and the engine's torch path (its RMSNorm, transformers' arithmetic) gives the same thing bit
    # for bit
    assert torch.equal(ref_n, TorchOps().add_rmsnorm(ref_r, None, w, EPS)[0])

    got_n, got_r = norm.add_rmsnorm_triton(x, res, w, EPS)
    assert torch.equal(got_r, ref_r)
    assert_kernel_matches(got_n, ref_n, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_no_residual_returns_x_and_norms_it(dtype):
    x, _, w = _inputs(7, 576, dtype, seed=1)
    ref_n, ref_r = norm.add_rmsnorm_torch(x, None, w, EPS)
    got_n, got_r = norm.add_rmsnorm_triton(x, None, w, EPS)
    assert ref_r is x and got_r is x
    assert torch.equal(ref_n, TorchOps().add_rmsnorm(x, None, w, EPS)[0])
    assert_kernel_matches(got_n, ref_n, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_output_element_written(dtype):
    """Into NaN-filled preallocated outputs, from strided inputs (row stride > H)."""
    T, H = 9, 576
    g = torch.Generator().manual_seed(3)
    wide = (torch.randn(T, H + 40, generator=g)).to(dtype).to(DEVICE)
    x = wide[:, 16 : 16 + H]
    res = torch.randn(T, 2 * H, generator=g).to(dtype).to(DEVICE)[:, ::2].contiguous()
    w = torch.randn(H, generator=g).to(dtype).to(DEVICE)
    ref_n, ref_r = norm.add_rmsnorm_torch(x, res, w, EPS)
    for fn in (norm.add_rmsnorm_torch, norm.add_rmsnorm_triton):
        out = torch.full((T, H), float("nan"), dtype=dtype, device=DEVICE)
        res_out = torch.full((T, H), float("nan"), dtype=dtype, device=DEVICE)
        got_n, got_r = fn(x, res, w, EPS, out=out, residual_out=res_out)
        assert got_n is out and got_r is res_out
        assert torch.equal(res_out, ref_r)
        assert_kernel_matches(out, ref_n, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("max_single_pass", [8192, 128])
def test_residual_in_place_and_two_pass_path(dtype, max_single_pass, monkeypatch):
    """residual_out=residual (in place) in the one-pass kernel and in the chunked two-pass kernel
    (forced with a small chunk so that 576 = 4.5 chunks, the last one masked)."""
    monkeypatch.setattr(norm, "MAX_SINGLE_PASS", max_single_pass)
    x, res, w = _inputs(5, 576, dtype, seed=4)
    ref_n, ref_r = norm.add_rmsnorm_torch(x, res, w, EPS)
    res_buf = res.clone()
    out = torch.full_like(x, float("nan"))
    got_n, got_r = norm.add_rmsnorm_triton(x, res_buf, w, EPS, out=out, residual_out=res_buf)
    assert got_r is res_buf and torch.equal(res_buf, ref_r)
    assert_kernel_matches(got_n, ref_n, dtype)
    # also without a residual in the two-pass path
    got_n, _ = norm.add_rmsnorm_triton(x, None, w, EPS)
    assert_kernel_matches(got_n, norm.add_rmsnorm_torch(x, None, w, EPS)[0], dtype)


def test_float32_weight_promotes_like_hf():
    """A float32 weight on bfloat16 activations gives float32 output, as `weight * x.to(dtype)`
    does."""
    x, res, w = _inputs(7, 64, torch.bfloat16, seed=5, weight_dtype=torch.float32)
    ref_n, _ = norm.add_rmsnorm_torch(x, res, w, EPS)
    got_n, _ = norm.add_rmsnorm_triton(x, res, w, EPS)
    assert ref_n.dtype == got_n.dtype == torch.float32
    torch.testing.assert_close(got_n, ref_n, rtol=2 * U[torch.bfloat16], atol=1e-6)
    assert (got_n == ref_n).float().mean().item() > 0.99
