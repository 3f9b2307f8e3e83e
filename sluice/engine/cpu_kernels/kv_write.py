"""Writing a step's K and V into the paged cache, in C (`kv_write.c`): the signature and results of
`sluice.engine.kernels.kv_cache.write_kv_torch` for float32 or bfloat16 K/V into a cache of their
own type (a copy) or an int8 one (its quantization rule, byte for byte), one pass instead of
several torch operations a layer."""

from __future__ import annotations

import torch

from . import library, require_library

_ACTIVATIONS = (torch.float32, torch.bfloat16)


def supports(k: torch.Tensor, k_cache: torch.Tensor) -> bool:
    return (
        k.device.type == "cpu"
        and k.dtype in _ACTIVATIONS
        and k_cache.dtype in (k.dtype, torch.int8)
        and library() is not None
    )


def write_kv_native(k, v, k_cache, v_cache, slot_mapping, k_scale=None, v_scale=None) -> None:
    """k, v [T, Hkv, D] float32 or bfloat16 (last dim contiguous) -> caches [num_blocks, Hkv, bs, D]
    of the same type, or int8 with float32 scales [num_blocks, Hkv]; slot_mapping [T] (negative:
    skipped). The tokens one step writes to a block must be consecutive in slot_mapping (the
    engine's layout)."""
    lib = require_library()
    if not supports(k, k_cache) or v.dtype != k.dtype or v_cache.dtype != k_cache.dtype:
        raise ValueError(
            f"write_kv_native writes float32 or bfloat16 K/V into a cache of their type or int8 on "
            f"the CPU, got {k.dtype} / {v.dtype} K/V and {k_cache.dtype} / {v_cache.dtype} caches"
        )
    quantized = k_cache.dtype == torch.int8
    if quantized != (k_scale is not None) or (k_scale is None) != (v_scale is None):
        raise ValueError(
            "an int8 cache needs k_scale and v_scale; a float32 or bfloat16 one takes none"
        )
    T, hkv, d = k.shape
    _, _, bs, _ = k_cache.shape
    slots = slot_mapping.to(torch.int64).contiguous()
    threads = torch.get_num_threads()
    for x, cache, scale in ((k, k_cache, k_scale), (v, v_cache, v_scale)):
        if x.stride(2) != 1 or not cache.is_contiguous():
            raise ValueError("k and v need a contiguous last dim, the caches must be contiguous")
        if not quantized:
            lib.sluice_write_kv_copy(
                x.data_ptr(),
                x.stride(0),
                x.stride(1),
                T,
                hkv,
                d,
                slots.data_ptr(),
                cache.data_ptr(),
                bs,
                x.element_size(),
                threads,
            )
            continue
        if not scale.is_contiguous() or scale.dtype != torch.float32:
            raise ValueError("scales must be contiguous float32 [num_blocks, Hkv]")
        rc = lib.sluice_write_kv_int8(
            x.data_ptr(),
            x.stride(0),
            x.stride(1),
            T,
            hkv,
            d,
            slots.data_ptr(),
            cache.data_ptr(),
            scale.data_ptr(),
            bs,
            int(x.dtype == torch.bfloat16),
            threads,
        )
        if rc != 0:
            raise RuntimeError(f"KV write kernel failed with code {rc}")
