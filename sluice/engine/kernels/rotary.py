"""Rotary position embedding applied in place to q and k (HF "rotate half" convention).

`rotary_*_(q, k, cos, sin) -> None`: q [T, Hq, D], k [T, Hkv, D], possibly strided views into the
fused qkv projection output [T, (Hq + 2*Hkv) * D] (last dim contiguous, any head and token stride),
so no copy is made and v is never touched. cos, sin [T, D/2] (or [T, 1, D/2], as
`RotaryEmbedding.cos_sin` returns them) are the float32 angles of each token's position. Each pair
(i, i + D/2) becomes (x1*cos - x2*sin, x2*cos + x1*sin), computed in float32 and stored in the
tensor's dtype.
"""

from __future__ import annotations

import torch

from sluice.engine.kernels._triton import tl, triton

from ._rounding import to_dtype

MAX_TILE = 4096  # elements of one program's [heads, D] tile (both halves)


def _check(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    if q.dim() != 3 or k.dim() != 3 or q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2]:
        raise ValueError(
            f"q [T, Hq, D] and k [T, Hkv, D] expected, got {tuple(q.shape)} and {tuple(k.shape)}"
        )
    if q.stride(-1) != 1 or k.stride(-1) != 1:
        raise ValueError("q and k need a contiguous last dim")
    T, _, D = q.shape
    if D % 2:
        raise ValueError(f"head_dim must be even, got {D}")
    cos = cos.reshape(cos.shape[0], -1)
    sin = sin.reshape(sin.shape[0], -1)
    if cos.shape != (T, D // 2) or sin.shape != (T, D // 2):
        raise ValueError(
            f"cos and sin must be [{T}, {D // 2}], got {tuple(cos.shape)} and {tuple(sin.shape)}"
        )
    return cos, sin


def _rotate_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    half = x.shape[-1] // 2
    x1 = x[..., :half].to(torch.float32)
    x2 = x[..., half:].to(torch.float32)
    o1 = x1 * cos - x2 * sin
    o2 = x2 * cos + x1 * sin  # both computed before either half is overwritten
    x[..., :half] = o1
    x[..., half:] = o2


def rotary_torch_(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Reference and CPU path, in place."""
    cos, sin = _check(q, k, cos, sin)
    cos = cos.to(torch.float32)[:, None, :]
    sin = sin.to(torch.float32)[:, None, :]
    _rotate_(q, cos, sin)
    _rotate_(k, cos, sin)


@triton.jit
def _rotate_heads(base, head_stride, h0, H, c, s, d, dmask, HALF, BLOCK_H: tl.constexpr):
    """Rotate heads [h0, h0 + BLOCK_H) of one token; `base` points at its head 0."""
    heads = h0 + tl.arange(0, BLOCK_H)
    mask = (heads < H)[:, None] & dmask[None, :]
    p1 = base + heads[:, None].to(tl.int64) * head_stride + d[None, :]
    p2 = p1 + HALF
    x1 = tl.load(p1, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(p2, mask=mask, other=0.0).to(tl.float32)
    dtype = base.dtype.element_ty
    tl.store(p1, to_dtype(x1 * c - x2 * s, dtype), mask=mask)
    tl.store(p2, to_dtype(x2 * c + x1 * s, dtype), mask=mask)


@triton.jit
def _rotary_kernel(
    q_ptr,
    k_ptr,
    cos_ptr,
    sin_ptr,
    q_tok_stride,
    q_head_stride,
    k_tok_stride,
    k_head_stride,
    cos_stride,
    sin_stride,
    HQ,
    HKV,
    HALF,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HK: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    # grid (T, q head blocks + k head blocks): one program rotates one block of heads of a token
    t = tl.program_id(0).to(tl.int64)
    hb = tl.program_id(1)
    d = tl.arange(0, BLOCK_HALF)
    dmask = d < HALF
    c = tl.load(cos_ptr + t * cos_stride + d, mask=dmask, other=0.0).to(tl.float32)[None, :]
    s = tl.load(sin_ptr + t * sin_stride + d, mask=dmask, other=0.0).to(tl.float32)[None, :]
    num_q_blocks = tl.cdiv(HQ, BLOCK_HQ)
    if hb < num_q_blocks:
        _rotate_heads(
            q_ptr + t * q_tok_stride,
            q_head_stride,
            hb * BLOCK_HQ,
            HQ,
            c,
            s,
            d,
            dmask,
            HALF,
            BLOCK_HQ,
        )
    else:
        _rotate_heads(
            k_ptr + t * k_tok_stride,
            k_head_stride,
            (hb - num_q_blocks) * BLOCK_HK,
            HKV,
            c,
            s,
            d,
            dmask,
            HALF,
            BLOCK_HK,
        )


def rotary_triton_(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Triton path, in place; same signature and results as `rotary_torch_`."""
    cos, sin = _check(q, k, cos, sin)
    if cos.stride(-1) != 1 or sin.stride(-1) != 1:
        cos, sin = cos.contiguous(), sin.contiguous()
    T, HQ, D = q.shape
    HKV = k.shape[1]
    if T == 0:
        return
    half = D // 2
    block_half = triton.next_power_of_2(half)
    cap = max(1, MAX_TILE // (2 * block_half))
    block_hq = min(triton.next_power_of_2(HQ), cap)
    block_hk = min(triton.next_power_of_2(HKV), cap)
    grid = (T, triton.cdiv(HQ, block_hq) + triton.cdiv(HKV, block_hk))
    _rotary_kernel[grid](
        q,
        k,
        cos,
        sin,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        cos.stride(0),
        sin.stride(0),
        HQ,
        HKV,
        half,
        BLOCK_HQ=block_hq,
        BLOCK_HK=block_hk,
        BLOCK_HALF=block_half,
        num_warps=4,
    )
