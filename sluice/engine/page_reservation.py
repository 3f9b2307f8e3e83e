"""Reserving the pages of a CPU KV cache in the background.

`paged_cache.lazy_zeros` allocates the cache as an anonymous mapping whose pages the kernel fills
with zeros when first touched, so a budget of gigabytes costs no start time. A native thread of
idle priority (`cpu_kernels/page_reserve.c`) then faults the pages in with
MADV_POPULATE_WRITE, which leaves their contents as they are (a step may write meanwhile): it
runs while a core is free, and a step that writes a page first only faults it in itself. Once
done the memory is the process's, as if allocated up front.

The thread is native, not Python: at idle priority on busy cores a Python thread is starved while
it holds the GIL, and the engine's thread waits for it; and a Python daemon thread ending just as
the interpreter did made the process abort now and then.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import mmap
import time

import torch

from .cpu_kernels import library

log = logging.getLogger("sluice.engine")

_MADV_POPULATE_WRITE = 23  # Linux 5.14+
_CHUNK_BYTES = 2 << 20  # per madvise call: the thread holds the process's mm lock this long
_RUNNING, _DONE, _STOPPED = 0, 1, 2


@functools.cache
def _madvise():
    madvise = ctypes.CDLL(None, use_errno=True).madvise
    madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    return madvise


def _page_range(t: torch.Tensor) -> tuple[int, int]:
    start = t.data_ptr() & ~(mmap.PAGESIZE - 1)
    return start, t.data_ptr() + t.numel() * t.element_size() - start


def populate(t: torch.Tensor) -> bool:
    """Fault in a CPU tensor's pages writable without changing its contents (safe while other
    threads write to it); False where the kernel cannot."""
    start, length = _page_range(t)
    return _madvise()(start, length, _MADV_POPULATE_WRITE) == 0


class Reservation:
    """The background reservation of some tensors' pages. It holds the tensors, so their memory
    outlives the thread's work on it."""

    def __init__(self, lib: ctypes.CDLL, handle: int, tensors: list[torch.Tensor], nbytes: int):
        self._lib, self._handle, self._tensors, self.nbytes = lib, handle, tensors, nbytes
        self._logged = False

    def state(self) -> int:
        return self._lib.sluice_reserve_state(self._handle) if self._handle else _STOPPED

    def done(self) -> bool:
        """Whether the thread has finished (all pages reserved, stopped, or failed)."""
        finished = self.state() != _RUNNING
        if finished and not self._logged:
            self._logged = True
            self._log_end()
        return finished

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until the thread has finished; False if `timeout` seconds passed first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self.done():
            if deadline is not None and time.monotonic() >= deadline:
                return False
            time.sleep(0.01)
        return True

    def close(self) -> None:
        """Stop the thread at its next chunk of pages and let go of the tensors. (A chunk in
        flight over memory freed meanwhile is harmless: populating never changes contents.)"""
        if self._handle:
            self._lib.sluice_reserve_release(self._handle)
            self._handle, self._tensors = 0, []

    def __del__(self) -> None:
        self.close()

    def _log_end(self) -> None:
        state = self.state()
        seconds = self._lib.sluice_reserve_seconds(self._handle) if self._handle else 0.0
        if state == _DONE:
            log.info(
                "KV cache: %.0f MiB reserved in the background in %.1f s",
                self.nbytes / 2**20,
                seconds,
            )
        elif state < 0:
            log.info("KV cache: reserving pages stopped: errno %d", -state)


def reserve_in_background(tensors: list[torch.Tensor]) -> Reservation | None:
    """Start reserving the pages of `lazy_zeros` CPU tensors; None where there is nothing to
    reserve or it cannot be done (no native library, a kernel without MADV_POPULATE_WRITE:
    steps then fault pages in as they first write them)."""
    tensors = [t for t in tensors if t.device.type == "cpu" and t.numel()]
    if not tensors:
        return None
    lib = library()
    if lib is None:
        log.info("KV cache: pages are reserved as steps first write them (no native library)")
        return None
    if not populate(tensors[0][:1]):  # a first block: can this kernel populate at all?
        log.info("KV cache: pages are reserved as steps first write them (no populate)")
        return None
    ranges = [_page_range(t) for t in tensors]
    starts = (ctypes.c_uint64 * len(ranges))(*(s for s, _ in ranges))
    lengths = (ctypes.c_uint64 * len(ranges))(*(n for _, n in ranges))
    handle = lib.sluice_reserve_start(starts, lengths, len(ranges), _CHUNK_BYTES)
    if not handle:
        log.info("KV cache: pages are reserved as steps first write them (no thread)")
        return None
    nbytes = sum(n for _, n in ranges)
    log.info("KV cache: reserving its %.0f MiB in the background at idle priority", nbytes / 2**20)
    return Reservation(lib, handle, tensors, nbytes)
