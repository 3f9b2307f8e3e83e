"""Deterministic mode's matmul in C (`cpu_kernels.fixed_order_linear`) against float64, and the
property it exists for: a row's result is the same bits whatever rows share the call and however
many threads run it (float32 and bfloat16, shapes with and without a partial last chunk of K)."""

from __future__ import annotations

import pytest
import torch

from sluice.engine.cpu_kernels.fixed_order_linear import fixed_order_linear

# SmolLM2's q/k/v and down shapes, a K with a partial last chunk, a tiny odd one
SHAPES = [(960, 576), (576, 1536), (131, 200), (5, 7)]
ROWS = [1, 2, 3, 5, 64, 67, 300]


def _data(n: int, k: int, dtype: torch.dtype, seed: int = 0, rows: int = 300):
    g = torch.Generator().manual_seed(seed + n + k)
    wide = torch.randn(rows, k + 9, generator=g)  # x as a column view: row stride != K
    x = wide[:, 3 : 3 + k].to(dtype)
    return x, torch.randn(n, k, generator=g).to(dtype), torch.randn(n, generator=g).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,k", SHAPES)
def test_matches_float64(n, k, dtype):
    x, w, b = _data(n, k, dtype)
    got = fixed_order_linear(x, w, b)
    want = x.double() @ w.double().T + b.double()
    assert got.dtype == dtype and got.shape == (x.shape[0], n)
    # float32 sums of k products: error ~ sqrt(k) units of the sum's magnitude scale; bfloat16
    # output: one rounding of the float32 result
    scale = (x.double().abs() @ w.double().abs().T + b.double().abs()).max()
    tol = 1e-6 if dtype == torch.float32 else 2.0**-8
    assert ((got.double() - want).abs() <= tol * scale + want.abs() * tol).all()
    torch.testing.assert_close(fixed_order_linear(x, w), got - b, rtol=0.02, atol=0.02)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,k", SHAPES)
def test_a_row_gets_the_same_bits_with_any_rows_beside_it(n, k, dtype):
    x, w, b = _data(n, k, dtype)
    alone = torch.cat([fixed_order_linear(x[i : i + 1], w, b) for i in range(x.shape[0])])
    for m in ROWS:
        for start in (0, 300 - m):
            assert torch.equal(
                fixed_order_linear(x[start : start + m], w, b), alone[start : start + m]
            ), (m, start)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_thread_count_changes_no_bit(dtype):
    x, w, b = _data(960, 576, dtype)
    threads = torch.get_num_threads()
    try:
        results = []
        for t in (1, 2, 3):
            torch.set_num_threads(t)
            results.append((fixed_order_linear(x, w, b), fixed_order_linear(x[:1], w, b)))
    finally:
        torch.set_num_threads(threads)
    for many, one in results[1:]:
        assert torch.equal(many, results[0][0]) and torch.equal(one, results[0][1])


def test_rejects_mismatched_operands():
    x = torch.zeros(2, 8)
    with pytest.raises(ValueError, match="weight"):
        fixed_order_linear(x, torch.zeros(3, 9))
    with pytest.raises(ValueError, match="weight"):
        fixed_order_linear(x, torch.zeros(3, 8, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="bias"):
        fixed_order_linear(x, torch.zeros(3, 8), torch.zeros(4))
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        fixed_order_linear(x.double(), torch.zeros(3, 8).double())
    assert fixed_order_linear(torch.zeros(0, 8), torch.zeros(3, 8)).shape == (0, 3)
