"""Decode attention through the paged cache, in C (`paged_decode.c`), for float32 on the CPU."""
from __future__ import annotations

import torch

from . import library

SUPPORTED_DTYPES = (torch.float32,)


def supports(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """True when the C kernel can serve this query and cache (else use the torch path)."""
    return (
        q.device.type == "cpu" and q.dtype in SUPPORTED_DTYPES and k_cache.dtype == q.dtype
        and library() is not None
    )


def paged_decode_cpu(
    q: torch.Tensor, out: torch.Tensor, tokens: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float, sliding_window: int | None, max_seq_len: int,
) -> None:
    """For each decode i, row tokens[i] of out [T, Hq, D] = attention of q's row tokens[i] [T, Hq, D]
    over the seq_lens[i] cached positions of its block table (the last sliding_window of them, if set).

    k_cache, v_cache [num_blocks, Hkv, block_size, D]; block_tables [n, max_blocks] int32;
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
    if block_tables.dtype != torch.int32 or seq_lens.dtype != torch.int32 or tokens.dtype != torch.int64:
        raise ValueError("block_tables and seq_lens must be int32, tokens int64")
    block_tables, seq_lens, tokens = block_tables.contiguous(), seq_lens.contiguous(), tokens.contiguous()
    rc = lib.sluice_paged_decode_f32(
        q.data_ptr(), q.stride(0), out.data_ptr(), out.stride(0), tokens.data_ptr(), n,
        k_cache.data_ptr(), v_cache.data_ptr(), block_tables.data_ptr(), block_tables.stride(0), seq_lens.data_ptr(),
        hkv, hq // hkv, d, bs, scale, sliding_window or 0, max_seq_len, torch.get_num_threads(),
    )
    if rc != 0:
        raise RuntimeError(f"paged decode kernel failed with code {rc}")
