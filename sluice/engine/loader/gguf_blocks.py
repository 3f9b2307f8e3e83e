"""A GGUF tensor's 4-bit blocks as the engine's int4 blocks hold them (w = d q + m, codes 0..15, a
float16 d and m a block of 32: `cpu_kernels.block_int8_linear`), read from the file's bytes: the
codes are the file's own, not found again from the values.

- Q4_1: d, m and codes as stored.
- Q4_0: w = d (q - 8): the same codes, m = -8 d (exact in float16).
- Q4_K: a super-block of 256 holds eight blocks of 32, each w = (d sc) q - (dmin mn) with 6-bit sc
  and mn: the same codes, d = d sc and m = -dmin mn rounded to float16 (within 2^-11 of one
  quantization step, where quantizing the values again could move a block onto another grid).

Int8 blocks (`Int8Blocks`) are read by the native code (`cpu_kernels.gguf_to_blocks`): Q8_0's own
codes, the other types' values quantized again. The 5-bit types' and Q6_K's blocks are
read as stored (`Q5Blocks`, `Q6Blocks`: the kernels' 5- and 6-bit formats), and quantized again to
int8 blocks only where a projection stacks such a matrix with others stored otherwise
(`stacked`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Self

import numpy as np
import torch

BLOCK = 32
FOUR_BIT_TYPES = ("Q4_0", "Q4_1", "Q4_K")
FLOAT_TYPES = ("F32", "F16", "BF16")


class BlockForm:
    """What the block forms share: stacking by rows and reordering rows (every field is a tensor
    with a row per matrix row)."""

    @classmethod
    def concat(cls, parts: list) -> Self:
        """Matrices stacked by rows (a fused projection's parts)."""
        return cls(*(torch.cat([getattr(p, f.name) for p in parts]) for f in fields(cls)))  # type: ignore[arg-type]

    def rows(self, rows: slice) -> Self:
        """A run of the rows (a fused matrix's part), as views."""
        return type(self)(*(getattr(self, f.name)[rows] for f in fields(self)))  # type: ignore[arg-type]

    def rows_permuted(self, permute) -> Self:
        """The rows reordered by `permute` (a function of a [rows, ...] array)."""
        return type(self)(
            *(
                torch.from_numpy(np.ascontiguousarray(permute(getattr(self, f.name).numpy())))
                for f in fields(self)  # type: ignore[arg-type]
            )
        )


@dataclass
class Int4Blocks(BlockForm):
    """A [N, K] matrix as 4-bit blocks along K (K a multiple of 32)."""

    codes: torch.Tensor  # uint8 [N, K], 0..15
    d: torch.Tensor  # float16 [N, K / 32]
    m: torch.Tensor  # float16 [N, K / 32]

    def values(self) -> np.ndarray:
        """The matrix as float32 [N, K]: d q + m, computed in float32."""
        n, k = self.codes.shape
        codes = self.codes.view(n, k // BLOCK, BLOCK).float()
        w = codes * self.d.float()[..., None] + self.m.float()[..., None]
        return w.view(n, k).numpy()


@dataclass
class Int8Blocks(BlockForm):
    """A [N, K] matrix as int8 blocks along K, w = d q (`cpu_kernels.gguf_to_blocks`: a GGUF
    tensor's own codes where it stores int8 blocks, quantized from its values where not)."""

    codes: torch.Tensor  # int8 [N, K], -127..127
    d: torch.Tensor  # float16 [N, K / 32]


@dataclass
class Q6Blocks(BlockForm):
    """A [N, K] matrix as GGUF's Q6_K stores it (K a multiple of 256): w = d sc (q - 32), a 6-bit
    code q, an int8 sc each 16 values and a float16 d each 256 (given here for each block of 32,
    so that every field has a row per matrix row)."""

    codes: torch.Tensor  # uint8 [N, K], 0..63
    d: torch.Tensor  # float16 [N, K / 32]
    sc: torch.Tensor  # int8 [N, K / 16]

    def as_int8(self) -> Int8Blocks:
        """The matrix as int8 blocks, its values quantized again by the Q8_0 rule."""
        from ..cpu_kernels.block_int8_linear import dequantize_q6_blocks, quantize_blocks

        k = self.codes.shape[1]
        return Int8Blocks(*quantize_blocks(dequantize_q6_blocks(self.codes, self.d, self.sc, k)))


@dataclass
class Q5Blocks(BlockForm):
    """A [N, K] matrix as 5-bit blocks along K (GGUF's Q5_0, Q5_1, Q5_K: w = d q + m, as
    `Int4Blocks` with a fifth bit)."""

    codes: torch.Tensor  # uint8 [N, K], 0..31
    d: torch.Tensor  # float16 [N, K / 32]
    m: torch.Tensor  # float16 [N, K / 32]

    def as_int8(self) -> Int8Blocks:
        """The matrix as int8 blocks, its values quantized again by the Q8_0 rule."""
        from ..cpu_kernels.block_int8_linear import dequantize_q4_blocks, quantize_blocks

        k = self.codes.shape[1]
        return Int8Blocks(*quantize_blocks(dequantize_q4_blocks(self.codes, self.d, self.m, k)))


# A matrix a file stores wider than 4 bits, as the native kernels read it
WideBlocks = Int8Blocks | Q5Blocks | Q6Blocks


def stacked(parts: list[WideBlocks]) -> WideBlocks:
    """Matrices stacked by rows (a fused projection's parts): as stored where they share a form,
    else every part as int8 blocks (a Q6_K matrix beside Q4_K ones read as int8)."""
    if len({type(p) for p in parts}) > 1:
        parts = [p.as_int8() if isinstance(p, (Q5Blocks, Q6Blocks)) else p for p in parts]
    return type(parts[0]).concat(parts)


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


@dataclass(frozen=True)
class StoredRows:
    """A matrix as the file stores it, for looking rows up (`weights.FileEmbedding`): where its
    bytes are, so that it can be mapped apart from the rest of the file (which is let go once the
    model is built, while the rows a lookup touches are all that is ever paged in of this)."""

    path: str
    offset: int  # of its first byte
    nbytes: int
    type_name: str  # GGUF's
    shape: tuple[int, int]

    def map(self) -> np.ndarray:
        """Its bytes, read-only, mapped from the file."""
        return np.memmap(self.path, np.uint8, "r", self.offset, (self.nbytes,))


@dataclass
class StoredProjections:
    """How a file stores a model's matrices, each read from it when the model builder asks for
    it. By (layer index, projection name as `weight_transforms.PROJECTIONS`): the 4-bit blocks of
    a projection whose matrices are all stored in 4 bits; the int8, 5-bit or Q6_K blocks of one
    whose matrices can all be read so (`gguf_to_blocks`); which have a matrix stored in more than 4
    bits (Q5_*, Q6_K, Q8_0: int4 weights keep those wider). And the LM head's blocks (the
    embedding's, when tied), and an untied embedding as the file stores it, where the file's
    types read so."""

    int4: dict[tuple[int, str], Callable[[], Int4Blocks]] = field(default_factory=dict)
    int8: dict[tuple[int, str], Callable[[], WideBlocks]] = field(default_factory=dict)
    wider: set[tuple[int, str]] = field(default_factory=set)
    head: Callable[[], WideBlocks] | None = None
    embed: Callable[[], StoredRows] | None = None  # untied only
