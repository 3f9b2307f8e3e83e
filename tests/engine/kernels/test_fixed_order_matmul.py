"""Deterministic mode's matmul on CUDA (`kernels.fixed_order_matmul`, in Triton's interpreter
here) against float64, and the property it exists for: a row's result is the same bits whatever
rows share the call (float32 and bfloat16; shapes with partial tiles of rows, columns and K). The
order is written out in the kernel, not left to `tl.dot`: in float32 it gives the CPU kernel's
bits (one FMA a step in k order), whatever BLAS the interpreter's numpy runs on."""

from __future__ import annotations

import pytest
import torch

from sluice.engine.cpu_kernels.fixed_order_linear import fixed_order_linear, pack_fixed_order
from sluice.engine.kernels.fixed_order_matmul import (
    fixed_order_matmul_torch,
    fixed_order_matmul_triton,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# a q/k/v-like shape, a partial tile of columns and an odd K, a tiny odd one
SHAPES = [(192, 64), (131, 45), (5, 7)]
ROWS = [1, 3, 16, 17, 40]


def _data(n: int, k: int, dtype: torch.dtype, rows: int = 40):
    g = torch.Generator().manual_seed(n + k)
    wide = torch.randn(rows, k + 9, generator=g)  # x as a column view: row stride != K
    x = wide[:, 3 : 3 + k].to(dtype).to(DEVICE)
    w = torch.randn(n, k, generator=g).to(dtype).to(DEVICE)
    return x, w, torch.randn(n, generator=g).to(dtype).to(DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,k", SHAPES)
def test_matches_float64(n, k, dtype):
    x, w, b = _data(n, k, dtype)
    for bias in (b, None):
        got = fixed_order_matmul_triton(x, w, bias)
        want = fixed_order_matmul_torch(x, w, bias)
        assert got.dtype == dtype and got.shape == (x.shape[0], n)
        # float32 sums of k products: within k units of roundoff of the sum of magnitudes; a
        # bfloat16 output: plus its rounding, a whole unit in the last place in the interpreter
        # (which truncates float32 to bfloat16)
        scale = x.double().abs() @ w.double().abs().T
        if bias is not None:
            scale = scale + bias.double().abs()
        tol = k * 2.0**-24 if dtype == torch.float32 else 2.0**-7
        assert ((got.double() - want).abs() <= tol * scale).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,k", SHAPES)
def test_a_row_gets_the_same_bits_with_any_rows_beside_it(n, k, dtype):
    x, w, b = _data(n, k, dtype)
    alone = torch.cat([fixed_order_matmul_triton(x[i : i + 1], w, b) for i in range(x.shape[0])])
    for m in ROWS:
        for start in (0, x.shape[0] - m):
            got = fixed_order_matmul_triton(x[start : start + m], w, b)
            assert torch.equal(got, alone[start : start + m]), (m, start)


@pytest.mark.parametrize("n,k", SHAPES)
def test_float32_gives_the_cpu_kernels_bits(n, k):
    x, w, b = _data(n, k, torch.float32)
    packed = pack_fixed_order(w.cpu())
    for bias in (b, None):
        cpu = fixed_order_linear(x.cpu(), packed, None if bias is None else bias.cpu())
        assert torch.equal(fixed_order_matmul_triton(x, w, bias).cpu(), cpu)


def test_refuses_what_does_not_multiply():
    x = torch.zeros(2, 8, device=DEVICE)
    with pytest.raises(ValueError, match="do not multiply"):
        fixed_order_matmul_triton(x, torch.zeros(4, 9, device=DEVICE))
    with pytest.raises(ValueError, match="bfloat16"):
        fixed_order_matmul_triton(x, torch.zeros(4, 8, dtype=torch.bfloat16, device=DEVICE))
