"""A layer's small operations in C (`cpu_kernels.layer_ops`) against the torch references of
`sluice.engine.kernels` and float64: residual add + RMSNorm, SiLU-and-multiply, rotary in place.
Row counts cover one thread (a few rows) and the threaded case (300 rows)."""
from __future__ import annotations

import pytest
import torch

from sluice.engine.cpu_kernels.layer_ops import add_rmsnorm_native, rotary_native_, silu_and_mul_native
from sluice.engine.kernels.activation import silu_and_mul_torch
from sluice.engine.kernels.norm import add_rmsnorm_torch
from sluice.engine.kernels.rotary import rotary_torch_

from test_rotary import _config, _cos_sin

ROWS = [1, 7, 300]


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


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
def test_silu_and_mul(rows):
    g = _gen(rows)
    inter = 1536
    wide = torch.randn(rows, 2 * inter + 8, generator=g) * 4
    wide[0, :6] = torch.tensor([0.0, -0.0, 100.0, -100.0, 90.0, -90.0])  # saturating gates
    x = wide[:, : 2 * inter]
    got = silu_and_mul_native(x)
    want = silu_and_mul_torch(x)
    torch.testing.assert_close(got, want, rtol=2e-6, atol=1e-30)
    gate, up = x[:, :inter].double(), x[:, inter:].double()
    torch.testing.assert_close(got.double(), gate * torch.sigmoid(gate) * up, rtol=2e-6, atol=1e-30)


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("hq,hkv,d", [(9, 3, 64), (8, 2, 128)])
def test_rotary_in_place(rows, hq, hkv, d):
    g = _gen(rows + d)
    qkv = torch.randn(rows, (hq + 2 * hkv) * d + 24, generator=g) * 2  # q, k, v column views of one matrix
    q = qkv[:, : hq * d].view(rows, hq, d)
    k = qkv[:, hq * d : (hq + hkv) * d].view(rows, hkv, d)
    positions = torch.randint(0, 100_000, (rows,), generator=g)
    cos, sin = _cos_sin(_config(hq, hkv, d), positions)
    want = qkv.clone()
    rotary_torch_(want[:, : hq * d].view(rows, hq, d), want[:, hq * d : (hq + hkv) * d].view(rows, hkv, d), cos, sin)
    rotary_native_(q, k, cos, sin)
    torch.testing.assert_close(qkv, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(qkv[:, (hq + hkv) * d :], want[:, (hq + hkv) * d :])  # v and the padding untouched
