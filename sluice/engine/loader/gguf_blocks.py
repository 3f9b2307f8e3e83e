"""A GGUF tensor's 4-bit blocks as the engine's int4 blocks hold them (w = d q + m, codes 0..15, a
float16 d and m a block of 32: `cpu_kernels.block_int8_linear`), read from the file's bytes: the
codes are the file's own, not found again from the values.

- Q4_1: d, m and codes as stored.
- Q4_0: w = d (q - 8): the same codes, m = -8 d (exact in float16).
- Q4_K: a super-block of 256 holds eight blocks of 32, each w = (d sc) q - (dmin mn) with 6-bit sc
  and mn: the same codes, d = d sc and m = -dmin mn rounded to float16 (within 2^-11 of one
  quantization step, where quantizing the values again could move a block onto another grid).

Wider types (Q5_*, Q6_K, Q8_0) are not read here: int8 blocks are quantized from their values
(Q8_0 gives back its own codes that way; the others land on a finer grid than theirs).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

BLOCK = 32
FOUR_BIT_TYPES = ("Q4_0", "Q4_1", "Q4_K")
FLOAT_TYPES = ("F32", "F16", "BF16")


@dataclass
class Int4Blocks:
    """A [N, K] matrix as 4-bit blocks along K (K a multiple of 32)."""

    codes: torch.Tensor  # uint8 [N, K], 0..15
    d: torch.Tensor  # float16 [N, K / 32]
    m: torch.Tensor  # float16 [N, K / 32]

    @staticmethod
    def concat(parts: list[Int4Blocks]) -> Int4Blocks:
        """Matrices stacked by rows (a fused projection's parts)."""
        return Int4Blocks(
            torch.cat([p.codes for p in parts]),
            torch.cat([p.d for p in parts]),
            torch.cat([p.m for p in parts]),
        )

    def values(self) -> np.ndarray:
        """The matrix as float32 [N, K]: d q + m, computed in float32."""
        n, k = self.codes.shape
        codes = self.codes.view(n, k // BLOCK, BLOCK).float()
        w = codes * self.d.float()[..., None] + self.m.float()[..., None]
        return w.view(n, k).numpy()

    def rows_permuted(self, permute) -> Int4Blocks:
        """The rows reordered by `permute` (a function of a [rows, ...] array)."""
        return Int4Blocks(
            *(
                torch.from_numpy(np.ascontiguousarray(permute(t.numpy())))
                for t in vars(self).values()
            )
        )


def _f16(raw: np.ndarray) -> np.ndarray:
    """Little-endian float16 from [n, 2] bytes, as float32 [n]."""
    return np.ascontiguousarray(raw).view(np.float16)[:, 0].astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[n, 16] bytes -> [n, 32] codes: the low nibbles are elements 0..15, the high 16..31."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=1)


def _k_scales(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K's 12 bytes of packed 6-bit scales and minimums -> sc, mn [n, 8]."""
    s = scales.astype(np.uint8)
    sc = np.empty((s.shape[0], 8), dtype=np.uint8)
    mn = np.empty_like(sc)
    sc[:, :4] = s[:, 0:4] & 63
    mn[:, :4] = s[:, 4:8] & 63
    sc[:, 4:] = (s[:, 8:12] & 0x0F) | ((s[:, 0:4] >> 6) << 4)
    mn[:, 4:] = (s[:, 8:12] >> 4) | ((s[:, 4:8] >> 6) << 4)
    return sc, mn


def int4_blocks(raw: np.ndarray, type_name: str, shape: tuple[int, int]) -> Int4Blocks:
    """The blocks of a Q4_0, Q4_1 or Q4_K tensor of `shape` [N, K] from its bytes (uint8)."""
    n, k = shape
    if type_name not in FOUR_BIT_TYPES:
        raise ValueError(f"{type_name} is not a 4-bit GGUF type ({', '.join(FOUR_BIT_TYPES)})")
    if type_name == "Q4_K":
        sb = raw.reshape(-1, 144)
        d, dmin = _f16(sb[:, 0:2]), _f16(sb[:, 2:4])
        sc, mn = _k_scales(sb[:, 4:16])
        qs = sb[:, 16:144].reshape(-1, 4, 32)  # four groups of 64 values: two blocks a group
        codes = np.stack([qs & 0x0F, qs >> 4], axis=2).reshape(-1, BLOCK)  # block order
        block_d = (d[:, None] * sc).reshape(-1)
        block_m = -(dmin[:, None] * mn).reshape(-1)
    else:
        size = 18 if type_name == "Q4_0" else 20
        blocks = raw.reshape(-1, size)
        block_d = _f16(blocks[:, 0:2])
        block_m = -8.0 * block_d if type_name == "Q4_0" else _f16(blocks[:, 2:4])
        codes = _nibbles(blocks[:, size - 16 :])
    nb = k // BLOCK
    return Int4Blocks(
        torch.from_numpy(np.ascontiguousarray(codes.reshape(n, k), dtype=np.uint8)),
        torch.from_numpy(block_d.astype(np.float16).reshape(n, nb)),
        torch.from_numpy(block_m.astype(np.float16).reshape(n, nb)),
    )


@dataclass
class StoredProjections:
    """How a file stores a model's projections, by (layer index, projection name as
    `weight_transforms.PROJECTIONS`): the 4-bit blocks of those whose matrices are all stored in
    4 bits, and which have a matrix stored in more (Q5_*, Q6_K, Q8_0: int4 weights keep those in
    int8)."""

    int4: dict[tuple[int, str], Int4Blocks] = field(default_factory=dict)
    wider: set[tuple[int, str]] = field(default_factory=set)
