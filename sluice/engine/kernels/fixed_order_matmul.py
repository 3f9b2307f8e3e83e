"""x @ W.T (+ bias) with every output element summed over K in one fixed order, whatever the number
of rows: deterministic mode's matmul on CUDA.

cuBLAS picks its algorithm, tile and split of K by the matrix shapes, so a row's result changes
with the rows beside it. Here one program computes a BLOCK_M x BLOCK_N tile of the output, walking
K from 0 upwards in BLOCK_K steps, accumulating in float32; the tile sizes are constants (never
chosen by M, N or K) and K is never split between programs, so a row's bits depend on that row
and the weight alone. Rows past M are masked (loaded as zeros, never stored), and so are the
columns of K past its end, whose products add exact zeros.

`fixed_order_matmul_torch` is the float64 reference the tests compare with; on the CPU
deterministic mode has a C kernel of its own (`cpu_kernels/fixed_order_linear.c`).
"""

from __future__ import annotations

import torch

from sluice.engine.kernels import interpreting
from sluice.engine.kernels._triton import tl, triton

# One tile shape for every call: 16 rows (tl.dot's least height), 64 output columns, 32 of K a step.
BLOCK_M, BLOCK_N, BLOCK_K = 16, 64, 32


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
    DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    row_ok = rows < M
    col_ok = cols < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + offs_k
        k_ok = ks < K
        x = tl.load(
            x_ptr + rows.to(tl.int64)[:, None] * stride_xm + ks[None, :],
            mask=row_ok[:, None] & k_ok[None, :],
            other=0.0,
        )
        w = tl.load(
            w_ptr + cols.to(tl.int64)[:, None] * stride_wn + ks[None, :],
            mask=col_ok[:, None] & k_ok[None, :],
            other=0.0,
        )
        acc = tl.dot(x.to(DOT_DTYPE), tl.trans(w.to(DOT_DTYPE)), acc, input_precision=DOT_PRECISION)
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
    # float32 stays exact (no TF32); the interpreter gets bfloat16 dots wrong, so it runs them in
    # float32 (see paged_attention)
    dot_dtype = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}[
        x.dtype
    ]
    if x.dtype == torch.bfloat16 and interpreting():
        dot_dtype = tl.float32
    has_bias = bias is not None
    _fixed_order_kernel[(triton.cdiv(m, BLOCK_M), triton.cdiv(n, BLOCK_N))](
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
        DOT_DTYPE=dot_dtype,
        DOT_PRECISION="ieee" if dot_dtype == tl.float32 else None,
        BLOCK_M=BLOCK_M,
        BLOCK_N=BLOCK_N,
        BLOCK_K=BLOCK_K,
        num_warps=4,
        num_stages=2,
    )
    return out.reshape(*lead, n)


__all__ = ["fixed_order_matmul_torch", "fixed_order_matmul_triton"]
