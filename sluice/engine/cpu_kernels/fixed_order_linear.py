"""x @ W.T (+ bias) with each output element summed in one fixed order (`fixed_order_linear.c`):
a row's result is the same bits whatever rows share the call and however many threads run it.
Deterministic mode's matmul; float32 or bfloat16 on the CPU."""

from __future__ import annotations

import torch

from . import require_library

DTYPES = (torch.float32, torch.bfloat16)


def fixed_order_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x [M, K] @ weight [N, K].T (+ bias [N]) -> [M, N], all of one type (float32 or
    bfloat16)."""
    if x.dtype not in DTYPES:
        raise ValueError(f"float32 or bfloat16 expected, got {x.dtype}")
    if x.dim() != 2 or x.stride(1) != 1 or x.device.type != "cpu":
        raise ValueError(
            f"x: a CPU matrix with contiguous rows expected, got {tuple(x.shape)} "
            f"strides {x.stride()} on {x.device}"
        )
    m, k = x.shape
    if weight.dtype != x.dtype or weight.dim() != 2 or weight.shape[1] != k:
        raise ValueError(
            f"weight: a {x.dtype} [N, {k}] matrix expected, got {tuple(weight.shape)} "
            f"{weight.dtype}"
        )
    n = weight.shape[0]
    if bias is not None and (bias.dtype != x.dtype or bias.shape != (n,)):
        raise ValueError(f"bias: a {x.dtype} vector of {n} expected")
    weight = weight.contiguous()
    bias = None if bias is None else bias.contiguous()
    out = torch.empty(m, n, dtype=x.dtype)
    if m == 0 or n == 0:
        return out
    rc = require_library().sluice_fixed_order_linear(
        x.data_ptr(),
        x.stride(0),
        weight.data_ptr(),
        None if bias is None else bias.data_ptr(),
        out.data_ptr(),
        out.stride(0),
        m,
        n,
        k,
        int(x.dtype == torch.bfloat16),
        torch.get_num_threads(),
    )
    if rc != 0:
        raise ValueError(f"fixed_order_linear does not take the shapes {tuple(x.shape)} x {(n, k)}")
    return out
