"""x @ W.T (+ bias) with each output element summed in one fixed order (`fixed_order_linear.c`):
a row's result is the same bits whatever rows share the call and however many threads run it.
Deterministic mode's matmul; float32 or bfloat16 on the CPU, on a weight packed once for it.

    packed = pack_fixed_order(weight)          # [N, K] -> panels of 32 columns, K-major
    y = fixed_order_linear(x, packed, bias)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import matmul_operands, require_library

DTYPES = (torch.float32, torch.bfloat16)


@dataclass(frozen=True)
class FixedOrderWeight:
    """A [N, K] weight packed for `fixed_order_linear` (the layout is the C kernel's)."""

    data: torch.Tensor  # uint8, the packed panels
    n: int
    k: int
    dtype: torch.dtype


def pack_fixed_order(weight: torch.Tensor) -> FixedOrderWeight:
    if weight.dtype not in DTYPES or weight.dim() != 2 or weight.device.type != "cpu":
        raise ValueError(
            f"a float32 or bfloat16 [N, K] CPU matrix expected, got {tuple(weight.shape)} "
            f"{weight.dtype} on {weight.device}"
        )
    n, k = weight.shape
    if k < 1:
        raise ValueError("K must be at least 1")
    bf16 = int(weight.dtype == torch.bfloat16)
    lib = require_library()
    data = torch.empty(lib.sluice_fixed_order_packed_bytes(n, k, bf16), dtype=torch.uint8)
    w = weight.detach().contiguous()
    lib.sluice_fixed_order_pack(w.data_ptr(), n, k, bf16, data.data_ptr())
    return FixedOrderWeight(data, n, k, weight.dtype)


def fixed_order_linear(
    x: torch.Tensor, weight: FixedOrderWeight, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x [M, K] @ W.T (+ bias [N]) -> [M, N], all of the weight's type."""
    if x.dtype != weight.dtype:
        raise ValueError(f"x is {x.dtype} but the weight is {weight.dtype}")
    bias = matmul_operands(x, bias, weight.n, weight.k)
    m = x.shape[0]
    out = torch.empty(m, weight.n, dtype=x.dtype)
    if m == 0 or weight.n == 0:
        return out
    rc = require_library().sluice_fixed_order_linear(
        x.data_ptr(),
        x.stride(0),
        weight.data.data_ptr(),
        None if bias is None else bias.data_ptr(),
        out.data_ptr(),
        out.stride(0),
        m,
        weight.n,
        weight.k,
        int(x.dtype == torch.bfloat16),
        torch.get_num_threads(),
    )
    if rc != 0:
        shapes = f"{tuple(x.shape)} x {(weight.n, weight.k)}"
        raise ValueError(f"fixed_order_linear does not take {shapes}")
    return out
