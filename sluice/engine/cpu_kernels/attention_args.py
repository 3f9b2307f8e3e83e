"""What the two attention kernels (`paged_decode`, `paged_prefill`) require of their arguments:
the types and shapes their vectorized code serves, and the layout checks both make before calling
C."""

from __future__ import annotations

import torch

# The vectorized form (`simd.h`): 16-token blocks, head size 64 or 128, at most 16 query heads per
# KV head. The prefill kernel exists only in that form; the decode kernel also has a generic one
# for float32 caches.
VECTOR_BLOCK_SIZE = 16
VECTOR_HEAD_SIZES = (64, 128)
VECTOR_MAX_GROUP = 16


# What a cache may hold for queries of each type (`CACHE_*` in simd.h numbers the cache types).
CACHE_KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.int8: 2}
CACHES_FOR_QUERIES = {
    torch.float32: (torch.float32, torch.int8),
    torch.bfloat16: (torch.bfloat16, torch.int8),
}


def types_served(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Float32 queries on a float32 or int8 cache, bfloat16 ones on a bfloat16 or int8 cache."""
    return k_cache.dtype in CACHES_FOR_QUERIES.get(q.dtype, ())


def vectorized_shape(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """q [T, Hq, D], k_cache [num_blocks, Hkv, block_size, D]: the vectorized kernels serve them."""
    _, hq, d = q.shape
    _, hkv, bs, _ = k_cache.shape
    return bs == VECTOR_BLOCK_SIZE and d in VECTOR_HEAD_SIZES and hq // hkv <= VECTOR_MAX_GROUP


def check_attention_args(q, out, k_cache, v_cache, k_scale, v_scale) -> int:
    """Raise ValueError unless the types pair up (`types_served`, out like q, v_cache like k_cache),
    q and out hold each token's heads as contiguous [Hq, D] rows, the caches are contiguous, and
    scales come exactly with an int8 cache (contiguous float32 [num_blocks, Hkv]). Returns the
    cache's kind (CACHE_KINDS)."""
    if not types_served(q, k_cache) or out.dtype != q.dtype or v_cache.dtype != k_cache.dtype:
        raise ValueError(
            f"q {q.dtype} / out {out.dtype} on a {k_cache.dtype} / {v_cache.dtype} cache: "
            "float32 queries read float32 or int8 caches, bfloat16 ones bfloat16 or int8 caches"
        )
    d = q.shape[2]
    for name, t in (("q", q), ("out", out)):
        if t.stride(2) != 1 or t.stride(1) != d:
            raise ValueError(
                f"{name}: each token's heads must be contiguous [Hq, D] rows, "
                f"got strides {t.stride()}"
            )
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("k_cache and v_cache must be contiguous")
    quantized = k_cache.dtype == torch.int8
    if quantized != (k_scale is not None) or (k_scale is None) != (v_scale is None):
        raise ValueError(
            "an int8 cache needs k_scale and v_scale; a float32 or bfloat16 one takes none"
        )
    if quantized and not (
        k_scale.dtype == v_scale.dtype == torch.float32
        and k_scale.is_contiguous()
        and v_scale.is_contiguous()
    ):
        raise ValueError("k_scale and v_scale must be contiguous float32 [num_blocks, Hkv]")
    return CACHE_KINDS[k_cache.dtype]
