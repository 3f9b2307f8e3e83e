"""One layer's paged KV cache: K and V blocks and, when quantized, their scales.

K and V are [num_blocks, Hkv, block_size, D] (`attention.kv_cache_shape`). In the model dtype they
hold the values themselves. Quantized (int8, or float8 e4m3 on CUDA) each (block, KV head) has one
float32 scale per tensor, value = stored * scale; a block's scale only grows as tokens are added,
and earlier entries are requantized when it does (see `kernels.kv_cache`). Per block and head
keeps outliers of one head or one stretch of context from costing the others precision.
"""

from __future__ import annotations

import math
import mmap
from dataclasses import dataclass

import torch

from .config import ModelConfig

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
    runner then reserves the pages in the background (`page_reservation`)."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    # (the tensor holds a reference to the mapping: it is unmapped with the last view of it)
    return torch.frombuffer(region, dtype=torch.uint8).view(dtype).view(shape)


def bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes of one block over all layers, K and V, scales included."""
    element = torch.empty(0, dtype=dtype).element_size()
    total = config.kv_bytes_per_token(element) * block_size
    if dtype in QUANTIZED_KV_DTYPES:
        total += 2 * config.num_hidden_layers * config.num_key_value_heads * 4  # float32 scales
    return total
