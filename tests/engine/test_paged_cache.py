"""A layer's KV cache on the CPU: zeros allocated without touching a page (a budget of gigabytes
costs no start time), then reserved in the background without disturbing what steps write
meanwhile."""

from __future__ import annotations

import os

import torch

from sluice.engine.paged_cache import LayerKVCache, populate, reserve_in_background

MIB = 1 << 20


def resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_a_cpu_cache_is_zeros_that_take_no_memory_until_used():
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
    cache.copy_blocks(torch.tensor([7]), torch.tensor([9]))
    assert torch.equal(cache.k[9], cache.k[7])


def test_reserving_in_the_background_keeps_what_was_written():
    shape = (2048, 4, 16, 128)  # 32 MiB each
    cache = LayerKVCache.allocate(shape, torch.float16, "cpu")
    before = resident_bytes()
    cache.k[100].fill_(3.0)
    thread = reserve_in_background(cache.tensors())
    assert thread is not None
    cache.v[2000].fill_(-2.0)  # a step writing while the pages are reserved
    thread.join(60)
    assert not thread.is_alive()
    if populate(cache.k[:1]):  # where the kernel reserves pages (Linux 5.14+): all of them now
        assert resident_bytes() - before >= 60 * MIB
    assert cache.k[100].eq(3.0).all() and cache.v[2000].eq(-2.0).all()
    assert not cache.k[:100].any() and not cache.k[101:].any() and not cache.v[:2000].any()


def test_a_quantized_cpu_cache_starts_at_zero_with_zero_scales():
    cache = LayerKVCache.allocate((64, 2, 16, 64), torch.int8, "cpu")
    assert cache.quantized and cache.k.dtype == torch.int8
    assert not cache.k.any() and not cache.v.any()
    assert cache.k_scale is not None and cache.k_scale.shape == (64, 2)
    assert not cache.k_scale.any()
