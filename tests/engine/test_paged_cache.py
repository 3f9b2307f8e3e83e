"""A layer's KV cache on the CPU: zeros that take memory only as their blocks are written, so the
default budget of gigabytes costs neither start time nor resident memory until requests use it."""

from __future__ import annotations

import os

import torch

from sluice.engine.paged_cache import LayerKVCache

MIB = 1 << 20


def resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_a_cpu_cache_is_zeros_that_take_memory_as_blocks_are_written():
    shape = (4096, 4, 16, 128)  # 64 MiB of bfloat16 for K, as much for V
    before = resident_bytes()
    cache = LayerKVCache.allocate(shape, torch.bfloat16, "cpu")
    assert resident_bytes() - before < 16 * MIB
    assert cache.k.shape == cache.v.shape == shape and cache.k.dtype == torch.bfloat16
    cache.k[7].fill_(1.5)
    cache.v[4000, 2].copy_(torch.arange(16 * 128, dtype=torch.bfloat16).view(16, 128))
    assert cache.k[7].eq(1.5).all() and not cache.k[6].any() and not cache.k[8].any()
    assert torch.equal(cache.v[4000, 2].flatten(), torch.arange(16 * 128).to(torch.bfloat16))
    assert not cache.v[4000, 1].any() and not cache.v[4000, 3].any()
    assert resident_bytes() - before < 16 * MIB  # two blocks' pages, not 128 MiB

    src, dst = torch.tensor([7]), torch.tensor([9])
    cache.copy_blocks(src, dst)
    assert torch.equal(cache.k[9], cache.k[7])


def test_a_quantized_cpu_cache_starts_at_zero_with_zero_scales():
    cache = LayerKVCache.allocate((64, 2, 16, 64), torch.int8, "cpu")
    assert cache.quantized and cache.k.dtype == torch.int8
    assert not cache.k.any() and not cache.v.any()
    assert cache.k_scale is not None and cache.k_scale.shape == (64, 2)
    assert not cache.k_scale.any()
