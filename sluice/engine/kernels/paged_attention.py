"""Decode attention over a paged KV cache, plain or quantized (int8 / fp8 with per-block scales).

Each sequence brings one new query token (already rotated) whose K/V are already in the cache at
position seq_lens[n] - 1; it attends to its whole context (or the last `sliding_window` tokens),
read through its block table. A layer's cache is [num_blocks, Hkv, block_size, D]; query head h
reads KV head h // G (grouped-query attention, Hq = G * Hkv). A quantized cache stores int8 or
float8_e4m3fn values with a float32 scale per (block, KV head): value = stored * scale.

`paged_decode_attention_torch` gathers each sequence's blocks into a padded batch and runs a masked
float32 softmax: the reference, and the fallback off CUDA.

`paged_decode_attention_triton` is flash-decoding. The context of each sequence is cut into
`num_splits` partitions; one program per (sequence, KV head, partition) computes all G query heads
of that KV head at once (so K/V are read once per group, not once per query head), walking its
partition in tiles of BLOCK_N tokens with an online softmax, and writes a normalized partial output
and its log-sum-exp. A second kernel merges the partitions. With one partition the first kernel
writes the output itself. Splitting lets a small batch of long contexts fill the GPU; a large batch
fills it already and runs unsplit. Quantized caches are read as stored: K's scale multiplies the
scores, V's scale the softmax weights, so no dequantized copy is ever made.
"""

from __future__ import annotations

import torch

from sluice.engine.kernels import interpreting
from sluice.engine.kernels._triton import tl, triton

QUANT_DTYPES = (torch.int8, torch.float8_e4m3fn)
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

# A partition shorter than this is not worth its extra launch-and-merge cost.
MIN_SPLIT_TOKENS = 256
# The merge kernel holds all partitions of one head in registers: keep them few.
MAX_SPLITS = 64

_LOG2E = 1.4426950408889634


def _check_args(
    q, k_cache, v_cache, block_tables, seq_lens, k_scale, v_scale, sliding_window
) -> None:
    """Shape and dtype checks shared by both implementations (a bad call fails the same way)."""
    if q.dim() != 3 or k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(
            f"want q [N, Hq, D] and caches [num_blocks, Hkv, block_size, D]; "
            f"got {tuple(q.shape)}, {tuple(k_cache.shape)}, {tuple(v_cache.shape)}"
        )
    n, hq, d = q.shape
    num_blocks, hkv, _, dk = k_cache.shape
    if dk != d or hq % hkv:
        raise ValueError(
            f"head dim {d} vs cache {dk}, or {hq} query heads not a multiple of {hkv} KV heads"
        )
    if q.dtype not in FLOAT_DTYPES:
        raise ValueError(f"q must be float32, bfloat16 or float16, not {q.dtype}")
    if k_cache.dtype != v_cache.dtype:
        raise ValueError(f"K cache {k_cache.dtype} and V cache {v_cache.dtype} differ")
    if k_cache.dtype in QUANT_DTYPES:
        for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
            if s is None or s.shape != (num_blocks, hkv) or s.dtype != torch.float32:
                raise ValueError(
                    f"a {k_cache.dtype} cache needs {name} float32 [{num_blocks}, {hkv}]"
                )
    elif k_cache.dtype != q.dtype:
        raise ValueError(
            f"cache dtype {k_cache.dtype} must be q's ({q.dtype}), int8 or float8_e4m3fn"
        )
    elif k_scale is not None or v_scale is not None:
        raise ValueError("k_scale / v_scale are for int8 or float8 caches only")
    if block_tables.dim() != 2 or block_tables.shape[0] != n or seq_lens.shape != (n,):
        raise ValueError(f"want block_tables [{n}, max_blocks] and seq_lens [{n}]")
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1, not {sliding_window}")


def paged_decode_attention_torch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """q [N, Hq, D] -> [N, Hq, D] in q's dtype: each query attends to its sequence's cached context.

    Gathers the blocks of every sequence into a padded [N, Hkv, L, D] float32 batch (L = longest
    context rounded up to a block), dequantizes, and takes a masked softmax. Block-table entries
    that hold no attended token (padding, blocks wholly before the window) are never dereferenced,
    so they may hold any value. A sequence of length 0 gives zeros."""
    _check_args(q, k_cache, v_cache, block_tables, seq_lens, k_scale, v_scale, sliding_window)
    n, hq, d = q.shape
    _, hkv, bs, _ = k_cache.shape
    g = hq // hkv
    if n == 0:
        return q.new_empty(n, hq, d)
    lens = seq_lens.to(torch.long)
    nblk = max(-(-int(lens.max()) // bs), 1)
    pos = torch.arange(nblk * bs, device=q.device)
    first = (
        (lens - sliding_window).clamp(min=0)
        if sliding_window is not None
        else torch.zeros_like(lens)
    )
    attend = (pos[None, :] < lens[:, None]) & (pos[None, :] >= first[:, None])  # [N, L]
    used = attend.view(n, nblk, bs).any(-1)
    table = torch.where(used, block_tables[:, :nblk].to(torch.long), 0)  # [N, nblk]

    def gather(cache, cache_scale):
        x = cache[table].float()  # [N, nblk, Hkv, bs, D]
        if cache_scale is not None:
            x = x * cache_scale[table][..., None, None]
        x = x.transpose(1, 2).reshape(n, hkv, nblk * bs, d)
        # Slots past a sequence's end may hold anything (NaN included); 0 * NaN would leak.
        return torch.where(attend[:, None, :, None], x, 0.0)

    k = gather(k_cache, k_scale)
    v = gather(v_cache, v_scale)
    qf = q.float().view(n, hkv, g, d)
    scores = torch.einsum("nkgd,nkld->nkgl", qf, k) * scale
    scores = scores.masked_fill(~attend[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    probs = torch.where(attend.any(-1)[:, None, None, None], probs, 0.0)  # empty context: no NaN
    out = torch.einsum("nkgl,nkld->nkgd", probs, v)
    return out.reshape(n, hq, d).to(q.dtype)


@triton.jit
def _decode_split_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    k_scale_ptr,
    v_scale_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
    qk_scale,
    sliding_window,
    num_splits,
    stride_qn,
    stride_qh,
    stride_kb,
    stride_kh,
    stride_kt,
    stride_vb,
    stride_vh,
    stride_vt,
    stride_ksb,
    stride_ksh,
    stride_vsb,
    stride_vsh,
    stride_btn,
    stride_on,
    stride_oh,
    stride_pn,
    stride_ph,
    stride_ps,
    stride_ln,
    stride_lh,
    GROUP: tl.constexpr,
    BLOCK_G: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    QUANT: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    ONE_SPLIT: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """One (sequence, KV head, partition): online softmax over the partition's tokens for the
    group's query heads (rows of a [BLOCK_G, D] tile, padded to a tl.dot-sized height)."""
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    seq_len = tl.load(seq_lens_ptr + seq).to(tl.int32)
    lo = seq_len * 0
    if USE_WINDOW:
        lo = tl.maximum(seq_len - sliding_window, 0)
    # Partitions are whole tiles counted from the tile holding the first attended token, so every
    # partition but the last is full and no tile straddles two partitions.
    tiles_lo = (lo // BLOCK_N) * BLOCK_N
    split_len = tl.cdiv(tl.cdiv(seq_len - tiles_lo, num_splits), BLOCK_N) * BLOCK_N
    start = tiles_lo + split * split_len
    end = tl.minimum(start + split_len, seq_len)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    g_mask = offs_g < GROUP
    d_mask = offs_d < HEAD_DIM
    heads = kv_head * GROUP + offs_g
    q = tl.load(
        q_ptr + seq.to(tl.int64) * stride_qn + heads[:, None] * stride_qh + offs_d[None, :],
        mask=g_mask[:, None] & d_mask[None, :],
        other=0.0,
    ).to(DOT_DTYPE)

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    table_row = block_tables_ptr + seq.to(tl.int64) * stride_btn
    k_head = k_cache_ptr + kv_head.to(tl.int64) * stride_kh
    v_head = v_cache_ptr + kv_head.to(tl.int64) * stride_vh

    for tile in range(start, end, BLOCK_N):
        pos = tile + offs_n
        valid = (pos >= lo) & (pos < end)
        # Masked: padding entries of the table are never read, so they may hold any value.
        block = tl.load(table_row + pos // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
        slot = (pos % BLOCK_SIZE)[:, None]
        kv_mask = valid[:, None] & d_mask[None, :]
        k = tl.load(
            k_head + block[:, None] * stride_kb + slot * stride_kt + offs_d[None, :],
            mask=kv_mask,
            other=0.0,
        )
        s = tl.dot(
            q, tl.trans(k.to(DOT_DTYPE)), input_precision=DOT_PRECISION
        )  # [BLOCK_G, BLOCK_N]
        if QUANT:
            ks = tl.load(
                k_scale_ptr + block * stride_ksb + kv_head * stride_ksh, mask=valid, other=0.0
            )
            s = s * (ks * qk_scale)[None, :]
        else:
            s = s * qk_scale
        s = tl.where(valid[None, :], s, float("-inf"))
        # Every tile of the loop holds at least one attended token, so m_new is finite.
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(
            v_head + block[:, None] * stride_vb + slot * stride_vt + offs_d[None, :],
            mask=kv_mask,
            other=0.0,
        )
        if QUANT:
            vs = tl.load(
                v_scale_ptr + block * stride_vsb + kv_head * stride_vsh, mask=valid, other=0.0
            )
            p = p * vs[None, :]
        acc = acc * alpha[:, None] + tl.dot(
            p.to(DOT_DTYPE), v.to(DOT_DTYPE), input_precision=DOT_PRECISION
        )
        m_i = m_new

    # An empty partition (or an empty context) leaves l_i = 0: output 0, log-sum-exp -inf.
    has = l_i > 0.0
    out = acc / tl.where(has, l_i, 1.0)[:, None]
    o_mask = g_mask[:, None] & d_mask[None, :]
    if ONE_SPLIT:
        tl.store(
            out_ptr + seq.to(tl.int64) * stride_on + heads[:, None] * stride_oh + offs_d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=o_mask,
        )
    else:
        part = seq.to(tl.int64) * stride_pn + heads * stride_ph + split * stride_ps
        tl.store(part_out_ptr + part[:, None] + offs_d[None, :], out, mask=o_mask)
        lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
        tl.store(
            part_lse_ptr + seq.to(tl.int64) * stride_ln + heads * stride_lh + split,
            lse,
            mask=g_mask,
        )


@triton.jit
def _decode_merge_kernel(
    part_out_ptr,
    part_lse_ptr,
    out_ptr,
    num_splits,
    stride_pn,
    stride_ph,
    stride_ps,
    stride_ln,
    stride_lh,
    stride_on,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    """One (sequence, query head): weight each partition's output by its share of the softmax."""
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_mask = offs_s < num_splits
    base = seq * stride_pn + head * stride_ph + offs_s * stride_ps
    lse = tl.load(
        part_lse_ptr + seq * stride_ln + head * stride_lh + offs_s, mask=s_mask, other=float("-inf")
    )
    m = tl.max(lse, 0)
    w = tl.exp2(lse - tl.where(m == float("-inf"), 0.0, m))  # empty partitions weigh 0
    den = tl.sum(w, 0)
    parts = tl.load(
        part_out_ptr + base[:, None] + offs_d[None, :],
        mask=s_mask[:, None] & (offs_d < HEAD_DIM)[None, :],
        other=0.0,
    )
    out = tl.sum(w[:, None] * parts, 0) / tl.where(den > 0.0, den, 1.0)
    tl.store(
        out_ptr + seq * stride_on + head * stride_oh + offs_d,
        out.to(out_ptr.dtype.element_ty),
        mask=offs_d < HEAD_DIM,
    )


def choose_num_splits(
    num_seqs: int, num_kv_heads: int, max_seq_len: int, device: torch.device
) -> int:
    """Partitions per sequence: enough programs to fill the GPU about twice over when the batch
    alone does not, each partition at least MIN_SPLIT_TOKENS long, at most MAX_SPLITS."""
    if device.type == "cuda":
        units = torch.cuda.get_device_properties(device).multi_processor_count
    else:
        units = 1  # the interpreter runs one program at a time: splitting only costs
    programs = max(num_seqs * num_kv_heads, 1)
    want = -(-2 * units // programs)
    useful = -(-max_seq_len // MIN_SPLIT_TOKENS)
    return max(1, min(want, useful, MAX_SPLITS))


def paged_decode_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    sliding_window: int | None = None,
    *,
    num_splits: int | None = None,
    max_seq_len: int | None = None,
    block_n: int | None = None,
    out: torch.Tensor | None = None,
    workspace: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Flash-decoding; same arguments and result as `paged_decode_attention_torch`.

    Tuning (keyword-only): `num_splits` partitions per sequence (default from `choose_num_splits`,
    which needs `max_seq_len`: pass it to spare a device sync); `block_n` tokens per tile (a power
    of two >= 16). `out` [N, Hq, D] in q's dtype receives the result; `workspace` = (partial
    outputs float32 [N, Hq, num_splits, D], log-sum-exps float32 [N, Hq, num_splits]) is the merge
    scratch when num_splits > 1 (both let a caller preallocate, e.g. for CUDA graphs)."""
    _check_args(q, k_cache, v_cache, block_tables, seq_lens, k_scale, v_scale, sliding_window)
    n, hq, d = q.shape
    _, hkv, bs, _ = k_cache.shape
    group = hq // hkv
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    elif out.shape != q.shape or out.dtype != q.dtype or out.stride(-1) != 1:
        raise ValueError(f"out must be {tuple(q.shape)} {q.dtype} with unit stride in the last dim")
    if n == 0:
        return out
    if q.stride(-1) != 1:
        q = q.contiguous()
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("caches need unit stride in the head dim")
    if num_splits is None:
        if max_seq_len is None:
            max_seq_len = int(seq_lens.max())
        num_splits = choose_num_splits(n, hkv, max_seq_len, q.device)
    if not 1 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"num_splits must be in [1, {MAX_SPLITS}], not {num_splits}")
    block_d = max(16, triton.next_power_of_2(d))  # tl.dot needs K >= 16
    if block_n is None:
        block_n = 64 if block_d <= 128 else 32
    if block_n < 16 or block_n & (block_n - 1):
        raise ValueError(f"block_n must be a power of two >= 16, not {block_n}")

    quant = k_cache.dtype in QUANT_DTYPES
    if not quant:
        k_scale = v_scale = torch.empty(1, 1, dtype=torch.float32, device=q.device)
    assert k_scale is not None and v_scale is not None  # a quantized cache comes with scales
    # tl.dot in q's dtype with float32 accumulation; float32 stays exact (no TF32). Triton's CPU
    # interpreter gets bfloat16 dots (and int8 -> bfloat16 casts) wrong, so there bfloat16 runs
    # its dots in float32; float16 keeps float16 dots, which the interpreter gets right.
    dot_dtype = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}[
        q.dtype
    ]
    if q.dtype == torch.bfloat16 and interpreting():
        dot_dtype = tl.float32

    one_split = num_splits == 1
    if one_split:
        part_out = part_lse = out  # unused
    else:
        want_out, want_lse = (n, hq, num_splits, d), (n, hq, num_splits)
        if workspace is None:
            part_out = torch.empty(want_out, dtype=torch.float32, device=q.device)
            part_lse = torch.empty(want_lse, dtype=torch.float32, device=q.device)
        else:
            part_out, part_lse = workspace
            if (
                part_out.shape != want_out
                or part_lse.shape != want_lse
                or part_out.dtype != torch.float32
                or part_lse.dtype != torch.float32
                or not part_out.is_contiguous()
                or not part_lse.is_contiguous()
            ):
                raise ValueError(f"workspace must be contiguous float32 {want_out} and {want_lse}")
    p_strides = (
        hq * num_splits * d,
        num_splits * d,
        d,
        hq * num_splits,
        num_splits,
    )  # both contiguous

    _decode_split_kernel[(n, hkv, num_splits)](
        q,
        k_cache,
        v_cache,
        k_scale,
        v_scale,
        block_tables,
        seq_lens,
        out,
        part_out,
        part_lse,
        scale * _LOG2E,
        sliding_window or 0,
        num_splits,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        k_scale.stride(0),
        k_scale.stride(1),
        v_scale.stride(0),
        v_scale.stride(1),
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        *p_strides,
        GROUP=group,
        BLOCK_G=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=d,
        BLOCK_D=block_d,
        BLOCK_SIZE=bs,
        BLOCK_N=block_n,
        QUANT=quant,
        USE_WINDOW=sliding_window is not None,
        ONE_SPLIT=one_split,
        DOT_DTYPE=dot_dtype,
        DOT_PRECISION="ieee" if dot_dtype == tl.float32 else None,
        num_warps=4,
        num_stages=2,
    )
    if not one_split:
        _decode_merge_kernel[(n, hq)](
            part_out,
            part_lse,
            out,
            num_splits,
            *p_strides,
            out.stride(0),
            out.stride(1),
            HEAD_DIM=d,
            BLOCK_D=block_d,
            BLOCK_S=triton.next_power_of_2(num_splits),
            num_warps=4,
        )
    return out


__all__ = ["choose_num_splits", "paged_decode_attention_torch", "paged_decode_attention_triton"]
