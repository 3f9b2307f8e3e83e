"""A layer's small operations in C (`cpu_kernels.layer_ops`) against the torch references of
`sluice.engine.kernels` and float64: residual add + RMSNorm, SiLU-and-multiply, rotary in place,
in float32 and bfloat16. Row counts cover one thread (a few rows) and the threaded case (300 rows).
In bfloat16 the kernels compute in float32 and round where the references round, so each result
is within half a bfloat16 step of float64 on the same (rounded) inputs."""

from __future__ import annotations

import pytest
import torch
from test_rotary import _config, _cos_sin

from sluice.engine.cpu_kernels.layer_ops import (
    add_rmsnorm_native,
    rotary_native_,
    silu_and_mul_native,
)
from sluice.engine.kernels.activation import silu_and_mul_torch
from sluice.engine.kernels.norm import add_rmsnorm_torch
from sluice.engine.kernels.rotary import rotary_torch_

ROWS = [1, 7, 300]


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def assert_one_bf16_rounding(got: torch.Tensor, f64: torch.Tensor) -> None:
    assert got.dtype == torch.bfloat16
    err = (got.double() - f64).abs()
    assert (err <= f64.abs() * 2.0**-8 + 1e-30).all(), err.max()


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("width", [576, 64])
@pytest.mark.parametrize("with_residual", [True, False])
def test_add_rmsnorm(rows, width, with_residual):
    g = _gen(rows + width)
    wide = torch.randn(rows, width + 40, generator=g) * 3  # x as a column view: row stride != width
    x = wide[:, 7 : 7 + width]
    residual = torch.randn(rows, width, generator=g) if with_residual else None
    weight = torch.randn(width, generator=g)
    before = wide.clone()
    got, got_res = add_rmsnorm_native(x, residual, weight, 1e-5)
    want, want_res = add_rmsnorm_torch(x, residual, weight, 1e-5)
    assert torch.equal(wide, before)  # x is read, never written
    torch.testing.assert_close(got_res, want_res, rtol=0, atol=0)  # one float32 add: exact
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    r64 = want_res.double()
    f64 = weight.double() * r64 / torch.sqrt(r64.pow(2).mean(-1, keepdim=True) + 1e-5)
    torch.testing.assert_close(got.double(), f64, rtol=1e-5, atol=1e-6)
    if residual is None:
        assert got_res is x


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_mul(rows, dtype):
    g = _gen(rows)
    inter = 1536
    wide = torch.randn(rows, 2 * inter + 8, generator=g) * 4
    wide[0, :6] = torch.tensor([0.0, -0.0, 100.0, -100.0, 90.0, -90.0])  # saturating gates
    x = wide.to(dtype)[:, : 2 * inter]
    got = silu_and_mul_native(x)
    gate, up = x[:, :inter].double(), x[:, inter:].double()
    f64 = gate * torch.sigmoid(gate) * up
    if dtype == torch.bfloat16:
        assert_one_bf16_rounding(got, f64)
        return
    torch.testing.assert_close(got, silu_and_mul_torch(x), rtol=2e-6, atol=1e-30)
    torch.testing.assert_close(got.double(), f64, rtol=2e-6, atol=1e-30)


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("hq,hkv,d", [(9, 3, 64), (8, 2, 128)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_in_place(rows, hq, hkv, d, dtype):
    g = _gen(rows + d)
    qkv = (torch.randn(rows, (hq + 2 * hkv) * d + 24, generator=g) * 2).to(
        dtype
    )  # q, k, v views of one matrix
    q = qkv[:, : hq * d].view(rows, hq, d)
    k = qkv[:, hq * d : (hq + hkv) * d].view(rows, hkv, d)
    positions = torch.randint(0, 100_000, (rows,), generator=g)
    cos, sin = _cos_sin(_config(hq, hkv, d), positions)
    want = qkv.clone()
    rotary_torch_(
        want[:, : hq * d].view(rows, hq, d),
        want[:, hq * d : (hq + hkv) * d].view(rows, hkv, d),
        cos,
        sin,
    )
    before = qkv.double()
    rotary_native_(q, k, cos, sin)
    if dtype == torch.bfloat16:
        c, s_ = cos.reshape(rows, 1, -1).double(), sin.reshape(rows, 1, -1).double()
        x = before[:, : (hq + hkv) * d].view(rows, hq + hkv, d)
        x1, x2 = x[..., : d // 2], x[..., d // 2 :]
        f64 = torch.cat([x1 * c - x2 * s_, x2 * c + x1 * s_], dim=-1)
        assert_one_bf16_rounding(qkv[:, : (hq + hkv) * d].view(rows, hq + hkv, d), f64)
    else:
        assert torch.equal(
            qkv[:, (hq + hkv) * d :], want[:, (hq + hkv) * d :]
        )  # v and the padding untouched


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("with_residual", [True, False])
def test_add_rmsnorm_bfloat16(rows, with_residual):
    """HF's order: the residual sum rounded to bfloat16, statistics in float32, the normalized value
    rounded to bfloat16, then multiplied by the weight and rounded again."""
    g = _gen(rows + 3)
    width = 576
    x = (torch.randn(rows, width + 40, generator=g) * 3).bfloat16()[:, 7 : 7 + width]
    residual = torch.randn(rows, width, generator=g).bfloat16() if with_residual else None
    weight = torch.randn(width, generator=g).bfloat16()
    got, got_res = add_rmsnorm_native(x, residual, weight, 1e-5)
    want, want_res = add_rmsnorm_torch(x, residual, weight, 1e-5)
    assert torch.equal(got_res, want_res)  # one add, rounded once: exact
    r64 = want_res.double()
    normed = (r64 / torch.sqrt(r64.pow(2).mean(-1, keepdim=True) + 1e-5)).bfloat16().double()
    # the statistics differ from float64 by float32 noise, which may move `normed` by one step
    # where it sits on a rounding boundary: nearly every element equals torch's, all are close
    assert (got == want).float().mean() > 0.99
    torch.testing.assert_close(got.double(), weight.double() * normed, rtol=2**-7, atol=1e-6)


def test_types_must_agree():
    x = torch.randn(3, 64)
    with pytest.raises(ValueError, match="weight"):
        add_rmsnorm_native(x, None, torch.ones(64, dtype=torch.bfloat16), 1e-5)
    with pytest.raises(ValueError):
        add_rmsnorm_native(x.bfloat16(), x, torch.ones(64, dtype=torch.bfloat16), 1e-5)
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        silu_and_mul_native(x.half())
