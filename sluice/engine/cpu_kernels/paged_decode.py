"""Decode attention through the paged cache, in C (`paged_decode.c`), on the CPU: float32 queries on
float32 caches of any shape; for block size 16 and head size 64 or 128 also bfloat16 queries on
bfloat16 caches, and either on int8 caches with per-(block, KV head) scales, read directly (no
dequantized copy)."""

from __future__ import annotations

import torch

from . import library, require_library
from .attention_args import check_attention_args, types_served, vectorized_shape


def supports(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """True when the C kernel can serve this query and cache (else use the torch path)."""
    if q.device.type != "cpu" or not types_served(q, k_cache) or library() is None:
        return False
    return (q.dtype == k_cache.dtype == torch.float32) or vectorized_shape(q, k_cache)


def paged_decode_cpu(
    q: torch.Tensor,
    out: torch.Tensor,
    tokens: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None,
    max_seq_len: int,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """For each decode i, row tokens[i] of out [T, Hq, D] = attention of q's row tokens[i]
    [T, Hq, D] over the seq_lens[i] cached positions of its block table (the last sliding_window of
    them, if set).

    q and out float32 or bfloat16; k_cache, v_cache [num_blocks, Hkv, block_size, D] of q's type, or
    int8 with k_scale, v_scale [num_blocks, Hkv] float32 (value = stored * scale); block_tables
    [n, max_blocks] int32;
    seq_lens [n] int32; tokens [n] int64; max_seq_len >= every seq_lens[i]."""
    lib = require_library()
    n = tokens.shape[0]
    _, hq, d = q.shape
    _, hkv, bs, _ = k_cache.shape
    kind = check_attention_args(q, out, k_cache, v_cache, k_scale, v_scale)
    if (
        block_tables.dtype != torch.int32
        or seq_lens.dtype != torch.int32
        or tokens.dtype != torch.int64
    ):
        raise ValueError("block_tables and seq_lens must be int32, tokens int64")
    block_tables, seq_lens, tokens = (
        block_tables.contiguous(),
        seq_lens.contiguous(),
        tokens.contiguous(),
    )
    rc = lib.sluice_paged_decode(
        q.data_ptr(),
        q.stride(0),
        out.data_ptr(),
        out.stride(0),
        tokens.data_ptr(),
        n,
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        k_scale.data_ptr() if k_scale is not None else None,
        v_scale.data_ptr() if v_scale is not None else None,
        block_tables.data_ptr(),
        block_tables.stride(0),
        seq_lens.data_ptr(),
        hkv,
        hq // hkv,
        d,
        bs,
        scale,
        sliding_window or 0,
        max_seq_len,
        kind,
        int(q.dtype == torch.bfloat16),
        torch.get_num_threads(),
    )
    if rc != 0:
        raise RuntimeError(f"paged decode kernel failed with code {rc}")
