"""Writing one step's new K and V into the paged KV cache, plain or quantized (int8, float8_e4m3fn).

`write_kv_*(k, v, k_cache, v_cache, slot_mapping, k_scale=None, v_scale=None) -> None`:
k, v [T, Hkv, D] (last dim contiguous; strided views into the qkv matrix are fine), caches
[num_blocks, Hkv, block_size, D], slot_mapping [T] integer with slot = block * block_size + offset;
a negative slot skips its token (padding). A cache in the model dtype gets a plain copy.

Quantized caches keep one float32 scale per (block, head), k_scale / v_scale [num_blocks, Hkv]:
a stored value means stored.float() * scale[block, head]. Blocks fill up over several steps, so a
step may have to raise the scale of a block that already holds tokens. The rule, per touched
(block, head), with QMAX = `kv_qmax(cache dtype)` (127 for int8, 448 for float8_e4m3fn):

- first = the smallest offset written this step. first == 0: the block (re)starts and its old
  contents and old scale are ignored. first > 0: entries [0, first) are valid, stored with s_old.
- s = max(s_old if first > 0 else 0, absmax(this step's values for the block and head) / QMAX,
  SCALE_FLOOR). The floor keeps the scale positive when everything written is zero.
- first > 0 and s > s_old: the valid entries are requantized, q' = quant(q * (s_old / s)).
  Entries at or past first + count are don't-care and left as they are.
- new tokens are stored as quant(value / s).

quant() is round-half-to-even then clamp to [-127, 127] for int8, and clamp to [-448, 448] then
round-to-nearest-even cast for float8_e4m3fn. So the scale is always max(running absmax / QMAX,
SCALE_FLOOR) of everything written to the block since it (re)started, and each (re)quantization
adds at most half a step at the scale of the moment to an entry's error (int8), or 2**-4 relative
plus half a subnormal step, 2**-10 * s (float8).

`dequantize_torch` reads blocks back as floats; `touched_blocks` lists, per block written in a step,
its first offset, token count and first token (the plan both paths follow).

What callers guarantee (vLLM's layout): tokens of a sequence fill its blocks from offset 0 upward;
a block being written belongs to one sequence; and the tokens one step writes to a block are
consecutive entries of slot_mapping (a sequence's tokens are contiguous in the flat batch). The
Triton path relies on the last point: it plans in the kernel, without a host sync, by letting the
first token of each block's run do that block's work (one program per (token, head); the others
exit), so there is no race on a block's scale.
"""

from __future__ import annotations

import torch

from sluice.engine.kernels._triton import tl, triton

SCALE_FLOOR = (
    1e-8  # far below real K/V magnitudes: a block whose absmax is 1e-6 still gets ~100 int8 steps
)
_QMAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}


def kv_qmax(cache_dtype: torch.dtype) -> float:
    """Largest magnitude a quantized cache dtype stores: 127 (int8), 448 (float8_e4m3fn)."""
    try:
        return _QMAX[cache_dtype]
    except KeyError:
        raise ValueError(
            f"{cache_dtype} is not a quantized KV cache dtype; use one of {list(_QMAX)}"
        ) from None


def is_quantized(cache_dtype: torch.dtype) -> bool:
    return cache_dtype in _QMAX


def _raw(cache: torch.Tensor) -> torch.Tensor:
    """float8 caches as bytes: indexing and `where` then work on any device and torch version."""
    return cache.view(torch.uint8) if cache.dtype == torch.float8_e4m3fn else cache


def _check(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale) -> bool:
    if k.dim() != 3 or v.shape != k.shape or k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError(
            f"k and v must be [T, Hkv, D] with a contiguous last dim, "
            f"got {tuple(k.shape)}, {tuple(v.shape)}"
        )
    T, H, D = k.shape
    if (
        k_cache.dim() != 4
        or v_cache.shape != k_cache.shape
        or v_cache.dtype != k_cache.dtype
        or k_cache.shape[1] != H
        or k_cache.shape[3] != D
        or k_cache.stride(-1) != 1
        or v_cache.stride(-1) != 1
    ):
        raise ValueError(
            f"caches must be [num_blocks, {H}, block_size, {D}] alike with a contiguous last dim, "
            f"got {tuple(k_cache.shape)}, {tuple(v_cache.shape)}"
        )
    if slot_mapping.shape != (T,) or slot_mapping.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"slot_mapping must be [{T}] int32/int64, "
            f"got {tuple(slot_mapping.shape)} {slot_mapping.dtype}"
        )
    if not is_quantized(k_cache.dtype):
        if k_cache.dtype != k.dtype or v.dtype != k.dtype:
            raise ValueError(
                f"an unquantized cache must have the dtype of k and v: {k_cache.dtype} vs {k.dtype}"
            )
        if k_scale is not None or v_scale is not None:
            raise ValueError("scales given for an unquantized cache")
        return False
    for s in (k_scale, v_scale):
        if s is None or s.shape != k_cache.shape[:2] or s.dtype != torch.float32:
            raise ValueError(
                f"a {k_cache.dtype} cache needs float32 scales of shape {tuple(k_cache.shape[:2])}"
            )
    return True


def _plan(slot_mapping: torch.Tensor, block_size: int):
    """Valid tokens and the blocks they touch: (token index, block, offset, touched blocks (sorted),
    each token's index into them, first offset per touched block)."""
    tok = (slot_mapping >= 0).nonzero().squeeze(1)
    slots = slot_mapping[tok].to(torch.int64)
    blk, off = slots // block_size, slots % block_size
    blocks, inv = torch.unique(blk, return_inverse=True)
    first = torch.full_like(blocks, block_size).scatter_reduce_(0, inv, off, "amin")
    return tok, blk, off, blocks, inv, first


def touched_blocks(slot_mapping: torch.Tensor, block_size: int):
    """Per block written this step: (block ids, first offset, token count, first token index),
    vectorized. Describes the plan the quantized write follows (the Triton kernel derives the same
    per block in-kernel)."""
    tok, _, _, blocks, inv, first = _plan(slot_mapping, block_size)
    count = torch.zeros_like(blocks).scatter_add_(0, inv, torch.ones_like(inv))
    start = torch.full_like(blocks, slot_mapping.shape[0]).scatter_reduce_(0, inv, tok, "amin")
    return blocks, first, count, start


def _quantize(y: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """float32 values already divided by the scale -> raw stored values (int8, or uint8 bytes of
    float8)."""
    if dtype == torch.int8:
        return y.round().clamp_(-127, 127).to(torch.int8)
    return y.clamp(-448.0, 448.0).to(dtype).view(torch.uint8)


def _stored_values(raw: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (raw.view(dtype) if dtype == torch.float8_e4m3fn else raw).to(torch.float32)


def _write_quantized_torch(x, cache, scale, tok, blk, off, blocks, inv, first) -> None:
    dtype = cache.dtype
    raw = _raw(cache)
    H, bs = cache.shape[1], cache.shape[2]
    x32 = x[tok].to(torch.float32)  # [n, H, D]
    amax = torch.zeros((blocks.numel(), H), dtype=torch.float32, device=x.device)
    amax.scatter_reduce_(0, inv[:, None].expand(-1, H), x32.abs().amax(-1), "amax")
    s_old = scale[blocks]
    cont = (first > 0)[:, None]
    s = torch.maximum(torch.where(cont, s_old, 0.0), amax / kv_qmax(dtype)).clamp_min_(SCALE_FLOOR)
    gb, gh = (cont & (s > s_old)).nonzero(as_tuple=True)
    if gb.numel():
        # requantize the valid entries [0, first) of the (block, head) pairs whose scale grows
        bid = blocks[gb]
        old = raw[bid, gh]  # [g, bs, D]
        ratio = (s_old[gb, gh] / s[gb, gh])[:, None, None]
        requant = _quantize(_stored_values(old, dtype) * ratio, dtype)
        valid = (torch.arange(bs, device=x.device)[None, :] < first[gb][:, None])[..., None]
        raw[bid, gh] = torch.where(valid, requant, old)
    raw[blk, :, off] = _quantize(x32 / s[inv][..., None], dtype)
    scale[blocks] = s


def write_kv_torch(k, v, k_cache, v_cache, slot_mapping, k_scale=None, v_scale=None) -> None:
    """Reference and CPU path (vectorized; the CPU engine runs it in every layer)."""
    quantized = _check(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    tok, blk, off, blocks, inv, first = _plan(slot_mapping, k_cache.shape[2])
    if tok.numel() == 0:
        return
    if not quantized:
        k_cache[blk, :, off] = k[tok]
        v_cache[blk, :, off] = v[tok]
        return
    _write_quantized_torch(k, k_cache, k_scale, tok, blk, off, blocks, inv, first)
    _write_quantized_torch(v, v_cache, v_scale, tok, blk, off, blocks, inv, first)


def dequantize_torch(
    cache: torch.Tensor, scale: torch.Tensor | None, block_ids: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """Blocks `block_ids` of a cache as `dtype` values: [len(block_ids), Hkv, block_size, D].
    With `scale` None the cache is unquantized and the blocks are just cast."""
    if scale is None:
        return cache[block_ids].to(dtype)
    vals = _stored_values(_raw(cache)[block_ids], cache.dtype)
    return (vals * scale[block_ids][:, :, None, None]).to(dtype)


# ----------------------------------------------------------------------------------------------
# Triton


@triton.jit
def _write_kv_kernel(
    k_ptr,
    v_ptr,
    kc_ptr,
    vc_ptr,
    slot_ptr,
    H,
    D,
    k_tok_stride,
    k_head_stride,
    v_tok_stride,
    v_head_stride,
    kc_blk_stride,
    kc_head_stride,
    kc_row_stride,
    vc_blk_stride,
    vc_head_stride,
    vc_row_stride,
    BS: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Plain copy: program (token, head block) moves a [BLOCK_H, D] tile of k and of v."""
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    blk = slot // BS
    off = slot % BS
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    mask = (heads < H)[:, None] & (d < D)[None, :]
    hh = heads[:, None].to(tl.int64)
    if slot >= 0:
        kv = tl.load(k_ptr + t * k_tok_stride + hh * k_head_stride + d[None, :], mask=mask)
        tl.store(
            kc_ptr + blk * kc_blk_stride + hh * kc_head_stride + off * kc_row_stride + d[None, :],
            kv,
            mask=mask,
        )
        vv = tl.load(v_ptr + t * v_tok_stride + hh * v_head_stride + d[None, :], mask=mask)
        tl.store(
            vc_ptr + blk * vc_blk_stride + hh * vc_head_stride + off * vc_row_stride + d[None, :],
            vv,
            mask=mask,
        )


@triton.jit
def _rint(x):
    """Round half to even, like torch.round (exact for |x| < 2**22)."""
    f = tl.floor(x)
    frac = x - f
    odd = (f - 2.0 * tl.floor(f * 0.5)) != 0.0
    return tl.where((frac > 0.5) | ((frac == 0.5) & odd), f + 1.0, f)


@triton.jit
def _encode(y, IS_FP8: tl.constexpr):
    """float32 (already divided by the scale) -> stored int8, or float8_e4m3fn bits as uint8.

    The float8 encoding is done on the bits, ties to even with |y| clamped to 448, so it equals
    torch's cast; Triton's interpreter has no exact float8 cast to lean on."""
    if IS_FP8:
        y = tl.minimum(tl.maximum(y, -448.0), 448.0)
        bits = y.to(tl.int32, bitcast=True)
        sign = (bits >> 24) & 0x80
        a = bits & 0x7FFFFFFF
        mag = a.to(tl.float32, bitcast=True)
        # normal range (|y| >= 2**-6): round the mantissa to 3 bits; a carry moves the exponent up
        normal = ((a + 0x7FFFF + ((a >> 20) & 1)) >> 20) - (120 << 3)
        # subnormal range: multiples of 2**-9 (code 8 is the smallest normal, 2**-6)
        sub = _rint(mag * 512.0).to(tl.int32)
        return (tl.where(mag < 0.015625, sub, normal) | sign).to(tl.uint8)
    else:
        return tl.minimum(tl.maximum(_rint(y), -127.0), 127.0).to(tl.int8)


@triton.jit
def _decode(q, IS_FP8: tl.constexpr):
    """Stored int8, or float8_e4m3fn bits as uint8 -> float32 (before the scale)."""
    if IS_FP8:
        code = q.to(tl.int32)
        e = (code >> 3) & 15
        m = code & 7
        normal = (((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)
        mag = tl.where(e == 0, m.to(tl.float32) * 0.001953125, normal)
        return tl.where((code & 0x80) != 0, -mag, mag)
    else:
        return q.to(tl.float32)


@triton.jit
def _quantize_block_head(
    x_ptr,
    x_tok_stride,
    x_head_stride,
    c_ptr,
    c_blk_stride,
    c_head_stride,
    c_row_stride,
    s_ptr,
    s_blk_stride,
    slot_ptr,
    i,
    h,
    blk,
    T,
    D,
    BS: tl.constexpr,
    QMAX: tl.constexpr,
    FLOOR: tl.constexpr,
    IS_FP8: tl.constexpr,
    BLOCK_T: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """All of one step's work on (block `blk`, head `h`) of one cache, whose first token is `i`."""
    d = tl.arange(0, BLOCK_D)
    dmask = d < D
    r = tl.arange(0, ROWS)
    x_head = x_ptr + h * x_head_stride
    c_head = c_ptr + blk * c_blk_stride + h * c_head_stride
    # pass 1 over the block's tokens (at most BS of them, from token i on): absmax, first offset
    amax = tl.zeros([ROWS], dtype=tl.float32)
    first_r = tl.full([ROWS], BS, dtype=tl.int64)
    for c in tl.static_range(0, BLOCK_T, ROWS):
        tok = i + c + r
        sl = tl.load(slot_ptr + tok, mask=tok < T, other=-1).to(tl.int64)
        member = (sl >= 0) & (sl // BS == blk)
        first_r = tl.minimum(first_r, tl.where(member, sl % BS, BS))
        vals = tl.load(
            x_head + tok[:, None] * x_tok_stride + d[None, :],
            mask=member[:, None] & dmask[None, :],
            other=0.0,
        ).to(tl.float32)
        amax = tl.maximum(amax, tl.max(tl.abs(vals), axis=1))
    first = tl.min(first_r, axis=0)
    s_addr = s_ptr + blk * s_blk_stride + h
    s_old = tl.load(s_addr)
    s = tl.maximum(tl.where(first > 0, s_old, 0.0), tl.math.div_rn(tl.max(amax, axis=0), QMAX))
    s = tl.maximum(s, FLOOR)
    if (first > 0) & (s > s_old):
        # the scale grows: requantize the block's valid entries [0, first)
        ratio = tl.math.div_rn(s_old, s)
        for c in tl.static_range(0, BLOCK_T, ROWS):
            rows = c + r
            m = (rows < first)[:, None] & dmask[None, :]
            p = c_head + rows[:, None] * c_row_stride + d[None, :]
            old = _decode(tl.load(p, mask=m, other=0), IS_FP8)
            tl.store(p, _encode(old * ratio, IS_FP8), mask=m)
    # pass 2: quantize and store the new tokens
    for c in tl.static_range(0, BLOCK_T, ROWS):
        tok = i + c + r
        sl = tl.load(slot_ptr + tok, mask=tok < T, other=-1).to(tl.int64)
        member = (sl >= 0) & (sl // BS == blk)
        m = member[:, None] & dmask[None, :]
        vals = tl.load(x_head + tok[:, None] * x_tok_stride + d[None, :], mask=m, other=0.0).to(
            tl.float32
        )
        q = _encode(tl.math.div_rn(vals, tl.zeros_like(vals) + s), IS_FP8)
        tl.store(c_head + (sl % BS)[:, None] * c_row_stride + d[None, :], q, mask=m)
    tl.store(s_addr, s)


@triton.jit
def _write_kv_quant_kernel(
    k_ptr,
    v_ptr,
    kc_ptr,
    vc_ptr,
    ks_ptr,
    vs_ptr,
    slot_ptr,
    T,
    D,
    k_tok_stride,
    k_head_stride,
    v_tok_stride,
    v_head_stride,
    kc_blk_stride,
    kc_head_stride,
    kc_row_stride,
    vc_blk_stride,
    vc_head_stride,
    vc_row_stride,
    ks_blk_stride,
    vs_blk_stride,
    BS: tl.constexpr,
    QMAX: tl.constexpr,
    FLOOR: tl.constexpr,
    IS_FP8: tl.constexpr,
    BLOCK_T: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Program (token i, head h) does (block of i, h) for k and v if i is that block's first token
    this step, i.e. no token of the same block comes within BLOCK_T entries before it."""
    i = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    slot = tl.load(slot_ptr + i).to(tl.int64)
    blk = slot // BS
    back = i - BLOCK_T + tl.arange(0, BLOCK_T)
    prev = tl.load(slot_ptr + back, mask=back >= 0, other=-1).to(tl.int64)
    seen = tl.max(((prev >= 0) & (prev // BS == blk)).to(tl.int32), axis=0)
    if (slot >= 0) & (seen == 0):
        _quantize_block_head(
            k_ptr,
            k_tok_stride,
            k_head_stride,
            kc_ptr,
            kc_blk_stride,
            kc_head_stride,
            kc_row_stride,
            ks_ptr,
            ks_blk_stride,
            slot_ptr,
            i,
            h,
            blk,
            T,
            D,
            BS,
            QMAX,
            FLOOR,
            IS_FP8,
            BLOCK_T,
            ROWS,
            BLOCK_D,
        )
        _quantize_block_head(
            v_ptr,
            v_tok_stride,
            v_head_stride,
            vc_ptr,
            vc_blk_stride,
            vc_head_stride,
            vc_row_stride,
            vs_ptr,
            vs_blk_stride,
            slot_ptr,
            i,
            h,
            blk,
            T,
            D,
            BS,
            QMAX,
            FLOOR,
            IS_FP8,
            BLOCK_T,
            ROWS,
            BLOCK_D,
        )


def write_kv_triton(k, v, k_cache, v_cache, slot_mapping, k_scale=None, v_scale=None) -> None:
    """Triton path; same signature and results as `write_kv_torch` (no host sync: CUDA-graph
    safe)."""
    quantized = _check(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    T, H, D = k.shape
    if T == 0:
        return
    slot_mapping = slot_mapping.contiguous()
    bs = k_cache.shape[2]
    block_d = triton.next_power_of_2(D)
    num_warps = 4 if block_d >= 128 else 2
    if not quantized:
        block_h = min(triton.next_power_of_2(H), max(1, 4096 // block_d))
        _write_kv_kernel[(T, triton.cdiv(H, block_h))](
            k,
            v,
            k_cache,
            v_cache,
            slot_mapping,
            H,
            D,
            k.stride(0),
            k.stride(1),
            v.stride(0),
            v.stride(1),
            *k_cache.stride()[:3],
            *v_cache.stride()[:3],
            BS=bs,
            BLOCK_H=block_h,
            BLOCK_D=block_d,
            num_warps=num_warps,
        )
        return
    for s in (k_scale, v_scale):
        if s.stride(1) != 1:
            raise ValueError("scales need a contiguous last dim")
    kc, vc = _raw(k_cache), _raw(v_cache)
    block_t = triton.next_power_of_2(bs)
    rows = min(block_t, max(1, 4096 // block_d))
    _write_kv_quant_kernel[(T, H)](
        k,
        v,
        kc,
        vc,
        k_scale,
        v_scale,
        slot_mapping,
        T,
        D,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        *kc.stride()[:3],
        *vc.stride()[:3],
        k_scale.stride(0),
        v_scale.stride(0),
        BS=bs,
        QMAX=kv_qmax(k_cache.dtype),
        FLOOR=SCALE_FLOOR,
        IS_FP8=k_cache.dtype == torch.float8_e4m3fn,
        BLOCK_T=block_t,
        ROWS=rows,
        BLOCK_D=block_d,
        num_warps=num_warps,
    )
