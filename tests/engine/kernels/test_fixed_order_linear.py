"""Deterministic mode's matmul in C (`cpu_kernels.fixed_order_linear`) against float64, and the
property it exists for: a row's result is the same bits whatever rows share the call and however
many threads run it (float32 and bfloat16, shapes with and without partial panels and an odd K).
Built for AVX2 instead of AVX-512, its float32 results are the same bits: each sum is one FMA a
step in k order, whatever the vector width."""

from __future__ import annotations

import pytest
import torch

from sluice.engine import cpu_kernels
from sluice.engine.cpu_kernels.fixed_order_linear import fixed_order_linear, pack_fixed_order

# SmolLM2's q/k/v and down shapes, a partial last panel with an odd K, a tiny odd one
SHAPES = [(960, 576), (576, 1536), (131, 201), (5, 7)]
ROWS = [1, 2, 3, 5, 6, 7, 64, 97, 300]


def _data(n: int, k: int, dtype: torch.dtype, seed: int = 0, rows: int = 300):
    g = torch.Generator().manual_seed(seed + n + k)
    wide = torch.randn(rows, k + 9, generator=g)  # x as a column view: row stride != K
    x = wide[:, 3 : 3 + k].to(dtype)
    return x, torch.randn(n, k, generator=g).to(dtype), torch.randn(n, generator=g).to(dtype)


def check_against_float64(n, k, dtype):
    x, w, b = _data(n, k, dtype)
    packed = pack_fixed_order(w)
    got = fixed_order_linear(x, packed, b)
    want = x.double() @ w.double().T + b.double()
    assert got.dtype == dtype and got.shape == (x.shape[0], n)
    # float32 sums of k products in order: within k units of roundoff of the sum of magnitudes;
    # bfloat16 output: plus one rounding of the result
    scale = x.double().abs() @ w.double().abs().T + b.double().abs()
    tol = k * 2.0**-24 if dtype == torch.float32 else 2.0**-8
    assert ((got.double() - want).abs() <= tol * scale).all()
    no_bias = fixed_order_linear(x, packed)
    assert torch.equal(fixed_order_linear(x[:1], packed), no_bias[:1])
    return got


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,k", SHAPES)
def test_matches_float64(n, k, dtype):
    check_against_float64(n, k, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,k", SHAPES)
def test_a_row_gets_the_same_bits_with_any_rows_beside_it(n, k, dtype):
    x, w, b = _data(n, k, dtype)
    packed = pack_fixed_order(w)
    alone = torch.cat([fixed_order_linear(x[i : i + 1], packed, b) for i in range(x.shape[0])])
    for m in ROWS:
        for start in (0, 300 - m):
            got = fixed_order_linear(x[start : start + m], packed, b)
            assert torch.equal(got, alone[start : start + m]), (m, start)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_thread_count_changes_no_bit(dtype):
    x, w, b = _data(960, 576, dtype)
    packed = pack_fixed_order(w)
    threads = torch.get_num_threads()
    try:
        results = []
        for t in (1, 2, 3):
            torch.set_num_threads(t)
            results.append((fixed_order_linear(x, packed, b), fixed_order_linear(x[:1], packed, b)))
    finally:
        torch.set_num_threads(threads)
    for many, one in results[1:]:
        assert torch.equal(many, results[0][0]) and torch.equal(one, results[0][1])


def test_an_avx2_build_gives_the_same_float32_bits(monkeypatch):
    wanted = {shape: check_against_float64(*shape, torch.float32) for shape in SHAPES}
    monkeypatch.setattr(cpu_kernels, "_state", {})  # (kept in the cache, keyed by the flags)
    monkeypatch.setenv("SLUICE_NATIVE_CFLAGS", "-mno-avx512f")
    assert cpu_kernels.library() is not None, cpu_kernels.unavailable_reason()
    for shape, want in wanted.items():
        assert torch.equal(check_against_float64(*shape, torch.float32), want), shape
    for shape in SHAPES:  # bfloat16 widened to float32 (no bfloat16 dot instruction here)
        check_against_float64(*shape, torch.bfloat16)


def test_rejects_mismatched_operands():
    packed = pack_fixed_order(torch.zeros(3, 8))
    with pytest.raises(ValueError, match="8 columns"):
        fixed_order_linear(torch.zeros(2, 9), packed)
    with pytest.raises(ValueError, match="bfloat16"):
        fixed_order_linear(torch.zeros(2, 8, dtype=torch.bfloat16), packed)
    with pytest.raises(ValueError, match="bias"):
        fixed_order_linear(torch.zeros(2, 8), packed, torch.zeros(4))
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        pack_fixed_order(torch.zeros(3, 8).double())
    assert fixed_order_linear(torch.zeros(0, 8), packed).shape == (0, 3)
