"""A layer's KV cache on the CPU: zeros allocated without touching a page (a budget of gigabytes
costs no start time), then reserved in the background without disturbing what steps write
meanwhile."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import torch

from sluice.engine.page_reservation import populate, reserve_in_background
from sluice.engine.paged_cache import LayerKVCache

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
    reservation = reserve_in_background(cache.tensors())
    assert reservation is not None
    cache.v[2000].fill_(-2.0)  # a step writing while the pages are reserved
    assert reservation.wait(60)
    assert reservation.state() == 1  # done, every page
    if populate(cache.k[:1]):  # where the kernel reserves pages (Linux 5.14+): all of them now
        assert resident_bytes() - before >= 60 * MIB
    assert cache.k[100].eq(3.0).all() and cache.v[2000].eq(-2.0).all()
    assert not cache.k[:100].any() and not cache.k[101:].any() and not cache.v[:2000].any()


def test_reserving_needs_no_python_thread():
    """At idle priority on busy cores a Python thread would be starved while holding the GIL,
    and the engine's thread would wait for it."""
    cache = LayerKVCache.allocate((4096, 4, 16, 128), torch.bfloat16, "cpu")
    threads = set(threading.enumerate())
    reservation = reserve_in_background(cache.tensors())
    assert reservation is not None
    assert set(threading.enumerate()) == threads
    assert reservation.wait(60)


def test_a_process_ends_cleanly_whatever_the_reservation_is_doing():
    """Exit while the thread is still reserving (a cache of 1 GiB), or just as it ends."""
    script = (
        "import sys, torch\n"
        "from sluice.engine.paged_cache import LayerKVCache\n"
        "from sluice.engine.page_reservation import reserve_in_background\n"
        "mib = int(sys.argv[1])\n"
        "cache = LayerKVCache.allocate((mib * 64, 4, 16, 128), torch.bfloat16, 'cpu')\n"
        "reservation = reserve_in_background(cache.tensors())\n"
        "assert reservation is not None\n"
        "print('reserving')\n"
    )
    for mib in (512, 512, 4, 4, 1):
        done = subprocess.run(
            [sys.executable, "-c", script, str(mib)], capture_output=True, text=True, timeout=120
        )
        assert (done.returncode, done.stdout, done.stderr) == (0, "reserving\n", "")


def test_a_closed_reservation_is_over():
    from sluice.engine.page_reservation import Reservation

    cache = LayerKVCache.allocate((64, 2, 16, 64), torch.bfloat16, "cpu")
    reservation = reserve_in_background(cache.tensors())
    assert isinstance(reservation, Reservation)
    reservation.close()
    assert reservation.done() and reservation.wait(0)
    reservation.close()  # twice is fine


def test_a_quantized_cpu_cache_starts_at_zero_with_zero_scales():
    cache = LayerKVCache.allocate((64, 2, 16, 64), torch.int8, "cpu")
    assert cache.quantized and cache.k.dtype == torch.int8
    assert not cache.k.any() and not cache.v.any()
    assert cache.k_scale is not None and cache.k_scale.shape == (64, 2)
    assert not cache.k_scale.any()
