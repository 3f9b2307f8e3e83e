"""Rounding units per dtype and the kernel-vs-reference check shared by the elementwise kernels."""

import torch

U = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}  # unit roundoff


def assert_kernel_matches(got, ref, dtype, atol: float = 1e-6):
    """Same dtype and shape, nothing left unwritten; float32 within 1e-5 relative, 16-bit types at
    most a unit in the last place apart (sum order, rsqrt, FMA) and almost always equal."""
    assert got.dtype == ref.dtype and got.shape == ref.shape
    assert not got.isnan().any()
    if dtype == torch.float32:
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=atol)
    else:
        torch.testing.assert_close(got.float(), ref.float(), rtol=2 * U[dtype], atol=atol)
        assert (got == ref).float().mean().item() > 0.99
