"""One layer's paged KV cache: K and V blocks and, when quantized, their scales.

K and V are [num_blocks, Hkv, block_size, D] (`attention.kv_cache_shape`). In the model dtype they
hold the values themselves. Quantized (int8, or float8 e4m3 on CUDA) each (block, KV head) has one
float32 scale per tensor, value = stored * scale; a block's scale only grows as tokens are added,
and earlier entries are requantized when it does (see `kernels.kv_cache`). Per block and head
keeps outliers of one head or one stretch of context from costing the others precision.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import math
import mmap
import os
import threading
import time
from dataclasses import dataclass

import torch

from .config import ModelConfig

log = logging.getLogger("sluice.engine")

QUANTIZED_KV_DTYPES = (torch.int8, torch.float8_e4m3fn)


@dataclass
class LayerKVCache:
    k: torch.Tensor
    v: torch.Tensor
    k_scale: torch.Tensor | None = None  # [num_blocks, Hkv] float32 when quantized
    v_scale: torch.Tensor | None = None

    @classmethod
    def allocate(cls, shape: tuple[int, int, int, int], dtype: torch.dtype, device) -> LayerKVCache:
        k = lazy_zeros(shape, dtype, device)
        v = lazy_zeros(shape, dtype, device)
        if dtype not in QUANTIZED_KV_DTYPES:
            return cls(k, v)
        scales = shape[:2]
        return cls(
            k,
            v,
            torch.zeros(scales, dtype=torch.float32, device=device),
            torch.zeros(scales, dtype=torch.float32, device=device),
        )

    @property
    def quantized(self) -> bool:
        return self.k_scale is not None

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.k, self.v, self.k_scale, self.v_scale) if t is not None]

    def copy_blocks(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy whole blocks src[i] -> dst[i] (scales included)."""
        for t in self.tensors():
            t.index_copy_(0, dst, t.index_select(0, src))

    def __iter__(self):  # `k_cache, v_cache = layer_cache`
        return iter((self.k, self.v))


def lazy_zeros(shape: tuple[int, ...], dtype: torch.dtype, device) -> torch.Tensor:
    """A tensor of zeros. On the CPU its memory is an anonymous mapping the kernel fills with
    zero pages as they are first touched, so allocating costs nothing: torch.zeros wrote every
    page of the default 4 GiB budget up front, 2-6 s of the start on a 2-core machine. The model
    runner then reserves the pages in the background (`reserve_in_background`)."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    # (the tensor holds a reference to the mapping: it is unmapped with the last view of it)
    return torch.frombuffer(region, dtype=torch.uint8).view(dtype).view(shape)


_MADV_POPULATE_WRITE = 23  # Linux 5.14+


@functools.cache
def _madvise():
    madvise = ctypes.CDLL(None, use_errno=True).madvise
    madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    return madvise


def populate(t: torch.Tensor) -> bool:
    """Fault in a CPU tensor's pages writable without changing its contents (safe while other
    threads write to it); False where the kernel cannot."""
    start = t.data_ptr() & ~(mmap.PAGESIZE - 1)
    end = t.data_ptr() + t.numel() * t.element_size()
    return _madvise()(start, end - start, _MADV_POPULATE_WRITE) == 0


def reserve_in_background(tensors: list[torch.Tensor]) -> threading.Thread | None:
    """Reserve the pages of `lazy_zeros` CPU tensors in a thread of idle priority: it runs while
    a core is free (at start, between requests), and a step that writes a page first only
    faults it in itself. Once done the memory is the process's, as if allocated up front."""
    tensors = [t for t in tensors if t.device.type == "cpu" and t.numel()]
    if not tensors:
        return None

    def run() -> None:
        started = time.monotonic()
        try:
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))  # this thread only
        except (AttributeError, OSError):
            pass
        for t in tensors:
            if not populate(t):
                log.info("KV cache: pages are reserved as steps first write them (no populate)")
                return
        log.info(
            "KV cache: %.0f MiB reserved in the background in %.1f s",
            sum(t.numel() * t.element_size() for t in tensors) / 2**20,
            time.monotonic() - started,
        )

    thread = threading.Thread(target=run, name="sluice-kv-reserve", daemon=True)
    thread.start()
    return thread


def bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes of one block over all layers, K and V, scales included."""
    element = torch.empty(0, dtype=dtype).element_size()
    total = config.kv_bytes_per_token(element) * block_size
    if dtype in QUANTIZED_KV_DTYPES:
        total += 2 * config.num_hidden_layers * config.num_key_value_heads * 4  # float32 scales
    return total
