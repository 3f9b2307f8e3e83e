"""Fused residual add + RMSNorm: one read of the hidden states, one write of each result.

`add_rmsnorm_*(x, residual, weight, eps) -> (normed, residual_out)` with HF's RMSNorm semantics:
residual_out = x + residual in the model dtype (rounded like a plain torch add; `x` itself when
`residual` is None), r32 = residual_out.float(), and
normed = weight * (r32 * rsqrt(mean(r32 ** 2) + eps)).to(dtype), the cast to the model dtype
happening before the multiply by the weight, exactly as `sluice.engine.model.RMSNorm` does.

`out` / `residual_out` (keyword-only, optional) are preallocated buffers to write into, e.g. to
reuse memory across steps; `residual_out` may be `residual` itself (in place). It is ignored when
`residual` is None.
"""

from __future__ import annotations

import torch

from sluice.engine.kernels._triton import tl, triton

from ._rounding import round_to

# Rows up to this width are normalized from registers in one pass; wider rows take two passes
# over global memory (sum of squares, then scale) so a program never holds more than this.
MAX_SINGLE_PASS = 8192


def _out_dtype(x: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    return torch.promote_types(weight.dtype, x.dtype)


def add_rmsnorm_torch(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    *,
    out: torch.Tensor | None = None,
    residual_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference and CPU path: (weight * rmsnorm(x + residual), x + residual)."""
    if residual is None:
        r = x
    elif residual_out is None:
        r = x + residual
    else:
        r = torch.add(x, residual, out=residual_out)
    r32 = r.to(torch.float32)
    normed = weight * (r32 * torch.rsqrt(r32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    if out is not None:
        out.copy_(normed)
        normed = out
    return normed, r


@triton.jit
def _add_rmsnorm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    res_out_ptr,
    x_stride,
    res_stride,
    out_stride,
    res_out_stride,
    H,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
    NUM_CHUNKS: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * x_stride
    res_row = res_ptr + row * res_stride
    out_row = out_ptr + row * out_stride
    res_out_row = res_out_ptr + row * res_out_stride
    dtype = x_ptr.dtype.element_ty
    out_dtype = out_ptr.dtype.element_ty
    cols = tl.arange(0, BLOCK)
    if NUM_CHUNKS == 1:
        # The whole row stays in registers: read once, write once.
        mask = cols < H
        r = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_RESIDUAL:
            r = round_to(r + tl.load(res_row + cols, mask=mask, other=0.0).to(tl.float32), dtype)
            tl.store(res_out_row + cols, r.to(dtype), mask=mask)
        rstd = tl.math.rsqrt(tl.sum(r * r, axis=0) / H + eps)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        y = round_to(round_to(r * rstd, dtype) * w, out_dtype)
        tl.store(out_row + cols, y.to(out_dtype), mask=mask)
    else:
        # Pass 1: residual sum (stored), sum of squares. Pass 2 rereads the stored sum (exactly
        # r in the model dtype), which keeps `residual_out is residual` (in place) correct.
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for c in tl.static_range(NUM_CHUNKS):
            idx = c * BLOCK + cols
            mask = idx < H
            r = tl.load(x_row + idx, mask=mask, other=0.0).to(tl.float32)
            if HAS_RESIDUAL:
                r = round_to(r + tl.load(res_row + idx, mask=mask, other=0.0).to(tl.float32), dtype)
                tl.store(res_out_row + idx, r.to(dtype), mask=mask)
            acc += r * r
        rstd = tl.math.rsqrt(tl.sum(acc, axis=0) / H + eps)
        tl.debug_barrier()  # this block's stores of pass 1 are visible to all its threads
        for c in tl.static_range(NUM_CHUNKS):
            idx = c * BLOCK + cols
            mask = idx < H
            if HAS_RESIDUAL:
                r = tl.load(res_out_row + idx, mask=mask, other=0.0).to(tl.float32)
            else:
                r = tl.load(x_row + idx, mask=mask, other=0.0).to(tl.float32)
            w = tl.load(w_ptr + idx, mask=mask, other=0.0).to(tl.float32)
            y = round_to(round_to(r * rstd, dtype) * w, out_dtype)
            tl.store(out_row + idx, y.to(out_dtype), mask=mask)


def add_rmsnorm_triton(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    *,
    out: torch.Tensor | None = None,
    residual_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton path, one program per row; same signature and results as `add_rmsnorm_torch`."""
    if x.dim() != 2 or x.stride(-1) != 1:
        raise ValueError(
            f"x must be [T, H] with a contiguous last dim, "
            f"got {tuple(x.shape)} strides {x.stride()}"
        )
    T, H = x.shape
    if weight.shape != (H,) or not weight.is_contiguous():
        raise ValueError(f"weight must be a contiguous [{H}], got {tuple(weight.shape)}")
    if out is None:
        out = torch.empty((T, H), dtype=_out_dtype(x, weight), device=x.device)
    has_res = residual is not None
    if residual is not None:
        if residual.shape != x.shape or residual.stride(-1) != 1 or residual.dtype != x.dtype:
            raise ValueError("residual must match x in shape and dtype, with a contiguous last dim")
        if residual_out is None:
            residual_out = torch.empty_like(x, memory_format=torch.contiguous_format)
        res_arg, res_out = residual, residual_out
    else:
        res_arg, res_out = x, x  # unused by the kernel
    for t in (out, res_out):
        if t.shape != x.shape or t.stride(-1) != 1:
            raise ValueError("outputs must be [T, H] with a contiguous last dim")
    if T == 0:
        return out, (res_out if has_res else x)
    block = min(triton.next_power_of_2(H), MAX_SINGLE_PASS)
    num_chunks = triton.cdiv(H, block)
    num_warps = min(max(block // 256, 1), 16)
    _add_rmsnorm_kernel[(T,)](
        x,
        res_arg,
        weight,
        out,
        res_out,
        x.stride(0),
        res_arg.stride(0),
        out.stride(0),
        res_out.stride(0),
        H,
        float(eps),
        HAS_RESIDUAL=has_res,
        BLOCK=block,
        NUM_CHUNKS=num_chunks,
        num_warps=num_warps,
    )
    return out, (res_out if has_res else x)
