"""SwiGLU gate: silu(gate) * up over the fused gate/up projection, in one pass.

`silu_and_mul_*(x) -> Tensor`: x [T, 2*I] holds [gate | up] per row (the engine's fused gate_up
matmul output); the result [T, I] is silu(x[:, :I]) * x[:, I:], computed in float32 and rounded once
to x's dtype (two roundings, as separate torch ops in bfloat16 would do, lose a little accuracy for
nothing). `out` (keyword-only, optional) is a preallocated [T, I] buffer to write into.
"""

from __future__ import annotations

import torch

from sluice.engine.kernels._triton import tl, triton

from ._rounding import to_dtype

BLOCK_COLS = 1024  # columns per program: SmolLM2's I=1536 gives two programs per row


def _check(x: torch.Tensor, out: torch.Tensor | None) -> int:
    if x.dim() != 2 or x.shape[1] % 2 or x.stride(-1) != 1:
        raise ValueError(
            f"x must be [T, 2*I] with a contiguous last dim, "
            f"got {tuple(x.shape)} strides {x.stride()}"
        )
    inter = x.shape[1] // 2
    if out is not None and (
        out.shape != (x.shape[0], inter) or out.dtype != x.dtype or out.stride(-1) != 1
    ):
        raise ValueError(
            f"out must be [{x.shape[0]}, {inter}] {x.dtype} with a contiguous last dim"
        )
    return inter


def silu_and_mul_torch(x: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """Reference and CPU path."""
    inter = _check(x, out)
    gate = x[:, :inter].to(torch.float32)
    up = x[:, inter:].to(torch.float32)
    y = (torch.nn.functional.silu(gate) * up).to(x.dtype)
    if out is None:
        return y
    return out.copy_(y)


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, x_stride, out_stride, inter, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    x_row = x_ptr + row * x_stride
    gate = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_row + inter + cols, mask=mask, other=0.0).to(tl.float32)
    y = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + row * out_stride + cols, to_dtype(y, out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul_triton(x: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """Triton path: grid (rows, column blocks); same signature and results as the torch one."""
    inter = _check(x, out)
    T = x.shape[0]
    if out is None:
        out = torch.empty((T, inter), dtype=x.dtype, device=x.device)
    if T == 0 or inter == 0:
        return out
    block = min(triton.next_power_of_2(inter), BLOCK_COLS)
    grid = (T, triton.cdiv(inter, block))
    _silu_and_mul_kernel[grid](
        x, out, x.stride(0), out.stride(0), inter, BLOCK=block, num_warps=4 if block >= 512 else 2
    )
    return out
