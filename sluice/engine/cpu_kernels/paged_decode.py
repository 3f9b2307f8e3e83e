"""Decode attention through the paged cache, in C (`paged_decode.c`), on the CPU: float32 caches of
any shape, and int8 caches with per-(block, KV head) scales read directly (no dequantized copy)
for block size 16 and head size 64 or 128."""
from __future__ import annotations

import torch

from . import library

INT8_BLOCK_SIZE = 16
INT8_HEAD_SIZES = (64, 128)
MAX_FAST_GROUP = 16


def supports(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """True when the C kernel can serve this query and cache (else use the torch path)."""
    if q.device.type != "cpu" or q.dtype != torch.float32 or library() is None:
        return False
    if k_cache.dtype == torch.float32:
        return True
    _, hq, d = q.shape
    _, hkv, bs, _ = k_cache.shape
    return (k_cache.dtype == torch.int8 and bs == INT8_BLOCK_SIZE and d in INT8_HEAD_SIZES
            and hq // hkv <= MAX_FAST_GROUP)


def paged_decode_cpu(
    q: torch.Tensor, out: torch.Tensor, tokens: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float, sliding_window: int | None, max_seq_len: int,
    k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
) -> None:
    """For each decode i, row tokens[i] of out [T, Hq, D] = attention of q's row tokens[i] [T, Hq, D]
    over the seq_lens[i] cached positions of its block table (the last sliding_window of them, if set).

    k_cache, v_cache [num_blocks, Hkv, block_size, D], float32, or int8 with k_scale, v_scale
    [num_blocks, Hkv] float32 (value = stored * scale); block_tables [n, max_blocks] int32;
    seq_lens [n] int32; tokens [n] int64; max_seq_len >= every seq_lens[i]."""
    lib = library()
    if lib is None:
        raise RuntimeError("native CPU kernels are unavailable")
    n = tokens.shape[0]
    _, hq, d = q.shape
    _, hkv, bs, _ = k_cache.shape
    for name, t in (("q", q), ("out", out)):
        if t.stride(2) != 1 or t.stride(1) != d:
            raise ValueError(f"{name}: each token's heads must be contiguous [Hq, D] rows, got strides {t.stride()}")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("k_cache and v_cache must be contiguous")
    quantized = k_cache.dtype == torch.int8
    if quantized != (k_scale is not None) or (k_scale is None) != (v_scale is None):
        raise ValueError("an int8 cache needs k_scale and v_scale; a float32 one takes none")
    if quantized and not (k_scale.dtype == v_scale.dtype == torch.float32 and k_scale.is_contiguous()
                          and v_scale.is_contiguous()):
        raise ValueError("k_scale and v_scale must be contiguous float32 [num_blocks, Hkv]")
    if block_tables.dtype != torch.int32 or seq_lens.dtype != torch.int32 or tokens.dtype != torch.int64:
        raise ValueError("block_tables and seq_lens must be int32, tokens int64")
    block_tables, seq_lens, tokens = block_tables.contiguous(), seq_lens.contiguous(), tokens.contiguous()
    rc = lib.sluice_paged_decode(
        q.data_ptr(), q.stride(0), out.data_ptr(), out.stride(0), tokens.data_ptr(), n,
        k_cache.data_ptr(), v_cache.data_ptr(), k_scale.data_ptr() if quantized else None,
        v_scale.data_ptr() if quantized else None, block_tables.data_ptr(), block_tables.stride(0),
        seq_lens.data_ptr(), hkv, hq // hkv, d, bs, scale, sliding_window or 0, max_seq_len, torch.get_num_threads(),
    )
    if rc != 0:
        raise RuntimeError(f"paged decode kernel failed with code {rc}")
