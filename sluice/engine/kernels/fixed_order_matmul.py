"""x @ W.T (+ bias) with every output element summed over K in one fixed order, whatever the number
of rows: deterministic mode's matmul on CUDA.

cuBLAS picks its algorithm, tile and split of K by the matrix shapes, so a row's result changes
with the rows beside it. `tl.dot` promises no order either: on a GPU it is the tensor cores', and
in Triton's interpreter it is numpy's BLAS, whose kernel gives a row other bits at another place in
the tile (seen with OpenBLAS's Haswell kernels: rows 6 to 15 of a 16-row tile). So the sum is
written out here: element (m, n) is one running float32 sum over k = 0, 1, ..., K - 1 in order, one
fused multiply-add a step (`tl.fma`, which rounds once on CUDA and in the interpreter alike), then
the bias, then one rounding to the output's dtype. That is the order of the CPU's kernel
(`cpu_kernels/fixed_order_linear.c`) for float32. A program computes a BLOCK_M x BLOCK_N tile of
the output; each element is its own chain, so the tile shape changes only the speed, never a bit,
and K is never split between programs. Rows past M and columns past N read the last row's or
column's values and are never stored.

`fixed_order_matmul_torch` is the float64 reference the tests compare with.
"""

from __future__ import annotations

import torch

from sluice.engine.kernels import interpreting
from sluice.engine.kernels._triton import tl, triton

# Tile shapes: speed only (see above). The interpreter runs one program at a time in Python, so it
# gets wide tiles and fewer programs.
CUDA_TILE = (16, 64)
INTERPRETER_TILE = (64, 256)


def fixed_order_matmul_torch(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """float64 x @ weight.T (+ bias): the reference."""
    out = x.double() @ weight.double().T
    if bias is not None:
        out = out + bias.double()
    return out


@triton.jit
def _fixed_order_kernel(
    x_ptr,
    w_ptr,
    b_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_om,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < M
    col_ok = cols < N
    # rows and columns past the end read the last one's values (never stored): no mask in the loop
    x_at = x_ptr + tl.minimum(rows, M - 1).to(tl.int64)[:, None] * stride_xm
    w_at = w_ptr + tl.minimum(cols, N - 1).to(tl.int64)[None, :] * stride_wn
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for _ in range(0, K):
        acc = tl.fma(tl.load(x_at).to(tl.float32), tl.load(w_at).to(tl.float32), acc)
        x_at += 1
        w_at += 1
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(
        out_ptr + rows.to(tl.int64)[:, None] * stride_om + cols[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=row_ok[:, None] & col_ok[None, :],
    )


def fixed_order_matmul_triton(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x [..., K] @ weight [N, K].T (+ bias [N]) in x's dtype, float32 sums in a fixed order."""
    if weight.dim() != 2 or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"x {tuple(x.shape)} and weight {tuple(weight.shape)} do not multiply")
    if x.dtype != weight.dtype:
        raise ValueError(f"x is {x.dtype} but the weight {weight.dtype}")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    if weight.stride(-1) != 1:
        weight = weight.contiguous()
    m, k = x2.shape
    n = weight.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out.reshape(*lead, n)
    block_m, block_n = INTERPRETER_TILE if interpreting() else CUDA_TILE
    has_bias = bias is not None
    _fixed_order_kernel[(triton.cdiv(m, block_m), triton.cdiv(n, block_n))](
        x2,
        weight,
        bias if has_bias else weight,
        out,
        m,
        n,
        k,
        x2.stride(0),
        weight.stride(0),
        out.stride(0),
        HAS_BIAS=has_bias,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        num_warps=4,
    )
    return out.reshape(*lead, n)


__all__ = ["fixed_order_matmul_torch", "fixed_order_matmul_triton"]
