"""silu_and_mul: Triton kernel vs torch reference vs float64 (interpreter on the CPU)."""

from __future__ import annotations

import pytest
import torch
from _tolerances import U, assert_kernel_matches

from sluice.engine.kernels import activation

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _input(T, inter, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, 2 * inter, generator=g) * 3
    x[0, :3] = torch.tensor([-80.0, 80.0, 0.0])  # exp overflow / saturation on the gate side
    return x.to(dtype).to(DEVICE)


def _float64(x):
    inter = x.shape[1] // 2
    g, u = x[:, :inter].double(), x[:, inter:].double()
    return g * torch.sigmoid(g) * u


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("inter", [1536, 100, 7])
@pytest.mark.parametrize("T", [1, 5, 17])
def test_silu_and_mul_matches_reference(T, inter, dtype):
    x = _input(T, inter, dtype, seed=T * 7919 + inter)
    ref = activation.silu_and_mul_torch(x)
    # reference: float32 math then one rounding to the dtype
    torch.testing.assert_close(ref.double(), _float64(x), rtol=U[dtype] + 1e-6, atol=1e-6)
    assert_kernel_matches(activation.silu_and_mul_triton(x), ref, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_output_element_written_strided_input(dtype):
    """Into a NaN-filled preallocated output, from x whose rows are strided (a view of a wider
    matrix)."""
    T, inter = 6, 1536
    wide = _input(T, inter + 64, dtype, seed=11)
    x = wide[:, 32 : 32 + 2 * inter]
    assert not x.is_contiguous()
    ref = activation.silu_and_mul_torch(x.contiguous())
    for fn in (activation.silu_and_mul_torch, activation.silu_and_mul_triton):
        out = torch.full((T, inter), float("nan"), dtype=dtype, device=DEVICE)
        assert fn(x, out=out) is out
        assert_kernel_matches(out, ref, dtype)


def test_output_slice_is_the_only_thing_written():
    """A preallocated `out` that is a column slice of a bigger buffer: columns around it stay
    NaN."""
    T, inter = 3, 100
    x = _input(T, inter, torch.float32, seed=12)
    buf = torch.full((T, inter + 20), float("nan"), device=DEVICE)
    out = buf[:, 10 : 10 + inter]
    activation.silu_and_mul_triton(x, out=out)
    assert_kernel_matches(out, activation.silu_and_mul_torch(x), torch.float32)
    assert buf[:, :10].isnan().all() and buf[:, 10 + inter :].isnan().all()
