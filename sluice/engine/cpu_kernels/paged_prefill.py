"""Causal attention of prefill chunks through the paged cache, in C (`paged_prefill.c`), on the CPU:
float32 queries over a float32 cache, bfloat16 ones over a bfloat16 cache, either over an int8
cache with per-(block, KV head) scales; block size 16 and head size 64 or 128 (`supports`)."""

from __future__ import annotations

import torch

from . import library, require_library
from .attention_args import check_attention_args, types_served, vectorized_shape


def supports(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """True when the C kernel can serve these chunks (else use SDPA)."""
    return (
        q.device.type == "cpu"
        and types_served(q, k_cache)
        and vectorized_shape(q, k_cache)
        and library() is not None
    )


def paged_prefill_cpu(
    q: torch.Tensor,
    out: torch.Tensor,
    starts: torch.Tensor,
    q_lens: torch.Tensor,
    seq_lens: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    sliding_window: int | None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """For each chunk i, rows starts[i] .. starts[i] + q_lens[i] - 1 of out [T, Hq, D] = causal
    attention of those rows of q over positions 0 .. seq_lens[i] - 1 of its block table (only the
    last sliding_window of them for each query, if set); the chunk's K/V are already in the cache.

    q and out float32 or bfloat16, the cache of q's type or int8; starts [n] int64, q_lens and
    seq_lens [n] int32, block_tables [n, max_blocks] int32; an int8 cache comes with k_scale,
    v_scale [num_blocks, Hkv] float32 (value = stored * scale)."""
    lib = require_library()
    _, hq, d = q.shape
    _, hkv, bs, _ = k_cache.shape
    kind = check_attention_args(q, out, k_cache, v_cache, k_scale, v_scale)
    if starts.dtype != torch.int64 or {q_lens.dtype, seq_lens.dtype, block_tables.dtype} != {
        torch.int32
    }:
        raise ValueError("starts must be int64; q_lens, seq_lens and block_tables int32")
    starts, q_lens, seq_lens, block_tables = (
        t.contiguous() for t in (starts, q_lens, seq_lens, block_tables)
    )
    rc = lib.sluice_paged_prefill(
        q.data_ptr(),
        q.stride(0),
        out.data_ptr(),
        out.stride(0),
        starts.data_ptr(),
        q_lens.data_ptr(),
        seq_lens.data_ptr(),
        starts.shape[0],
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        k_scale.data_ptr() if k_scale is not None else None,
        v_scale.data_ptr() if v_scale is not None else None,
        block_tables.data_ptr(),
        block_tables.stride(0),
        hkv,
        hq // hkv,
        d,
        bs,
        scale,
        sliding_window or 0,
        kind,
        int(q.dtype == torch.bfloat16),
        torch.get_num_threads(),
    )
    if rc != 0:
        raise RuntimeError(f"paged prefill kernel failed with code {rc}")
