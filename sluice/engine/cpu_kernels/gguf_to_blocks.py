"""A GGUF tensor's blocks as int8 blocks of 32 (`block_int8_linear`'s codes and scales), straight
from the file's bytes by the native code (`gguf_to_blocks.c`): Q8_0 and Q5_0 as stored, Q6_K, Q4_K,
Q4_0 and Q4_1 decoded and quantized by GGUF's Q8_0 rule with the bits of
`block_int8_linear.quantize_blocks` over numpy's decoded values.

    codes, scales = gguf_int8_blocks(raw, "Q6_K", (n, k))   # int8 [N, K], float16 [N, K / 32]
    codes, d, m = gguf_int4_blocks(raw, "Q4_K", (n, k))     # uint8 0..15, float16, float16
    codes, d, sc = gguf_q6_blocks(raw, (n, k))               # uint8 0..63, float16, int8
    codes, d, m = gguf_q5_blocks(raw, "Q5_K", (n, k))       # uint8 0..31, float16, float16

`gguf_rows(raw, type_name, shape, ids)` decodes some rows of such a tensor to float32 (an
embedding looked up in the file's own blocks). `gguf_int4_blocks` gives the 4-bit types' own
blocks, as `loader.gguf_blocks.int4_blocks` does with numpy (the same values; that one also serves
where the native code is not built), `gguf_q5_blocks` the 5-bit types' and `gguf_q6_blocks`
Q6_K's own (the kernel's 5- and 6-bit formats).
"""

from __future__ import annotations

import numpy as np
import torch

from . import require_library

# GGML's numbers for the types the native code reads
TYPE_NUMBERS = {
    "Q4_0": 2,
    "Q4_1": 3,
    "Q5_0": 6,
    "Q5_1": 7,
    "Q8_0": 8,
    "Q4_K": 12,
    "Q5_K": 13,
    "Q6_K": 14,
}
INT8_TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q8_0", "Q4_K", "Q6_K")  # (and the rows read from them)
INT4_TYPES = ("Q4_0", "Q4_1", "Q4_K")
Q5_TYPES = ("Q5_0", "Q5_1", "Q5_K")
BLOCK = 32


def _bytes_of(raw: np.ndarray, type_name: str, shape: tuple[int, int], types) -> np.ndarray:
    if type_name not in types:
        raise ValueError(f"{type_name} is not read so ({', '.join(types)})")
    n, k = shape
    data = np.ascontiguousarray(raw, dtype=np.uint8).reshape(-1)
    if data.size != n * require_library().sluice_gguf_row_bytes(TYPE_NUMBERS[type_name], k):
        raise ValueError(f"{data.size} bytes are not a [{n}, {k}] {type_name} tensor")
    return data


def gguf_int8_blocks(
    raw: np.ndarray, type_name: str, shape: tuple[int, int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """A [N, K] tensor stored as `type_name` (its bytes, uint8) as int8 codes [N, K] and float16
    scales [N, K / 32]."""
    data = _bytes_of(raw, type_name, shape, INT8_TYPES)
    n, k = shape
    lib = require_library()
    kind = TYPE_NUMBERS[type_name]
    codes = torch.empty(n, k, dtype=torch.int8)
    scales = torch.empty(n, k // BLOCK, dtype=torch.float32)
    rc = lib.sluice_gguf_to_int8_blocks(
        data.ctypes.data, kind, n, k, codes.data_ptr(), scales.data_ptr(), torch.get_num_threads()
    )
    if rc != 0:
        raise ValueError(f"K = {k} does not split into {type_name} blocks")
    return codes, scales.to(torch.float16)


def gguf_int4_blocks(
    raw: np.ndarray, type_name: str, shape: tuple[int, int]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A [N, K] tensor stored in 4 bits as its codes uint8 [N, K] (0..15) and each block's d and m
    float16 [N, K / 32] (w = d q + m)."""
    return _dm_blocks(raw, type_name, shape, INT4_TYPES)


def gguf_q5_blocks(
    raw: np.ndarray, type_name: str, shape: tuple[int, int]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A [N, K] tensor stored in 5 bits (Q5_0, Q5_1, Q5_K) as its codes uint8 [N, K] (0..31) and
    each block's d and m float16 [N, K / 32] (w = d q + m; Q5_K's d sc and -(dmin mn) rounded to
    float16, as Q4_K's are)."""
    return _dm_blocks(raw, type_name, shape, Q5_TYPES)


def _dm_blocks(
    raw: np.ndarray, type_name: str, shape: tuple[int, int], types: tuple[str, ...]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    data = _bytes_of(raw, type_name, shape, types)
    n, k = shape
    codes = torch.empty(n, k, dtype=torch.uint8)
    d, m = (torch.empty(n, k // BLOCK, dtype=torch.float32) for _ in range(2))
    rc = require_library().sluice_gguf_to_dm_blocks(
        data.ctypes.data,
        TYPE_NUMBERS[type_name],
        n,
        k,
        codes.data_ptr(),
        d.data_ptr(),
        m.data_ptr(),
        torch.get_num_threads(),
    )
    if rc != 0:
        raise ValueError(f"K = {k} does not split into {type_name} blocks")
    return codes, d.to(torch.float16), m.to(torch.float16)


def gguf_q6_blocks(
    raw: np.ndarray, shape: tuple[int, int]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A [N, K] Q6_K tensor as its codes uint8 [N, K] (0..63), d float16 [N, K / 32] (each block
    of 32 its super-block's) and sc int8 [N, K / 16]: w = d sc (q - 32)."""
    data = _bytes_of(raw, "Q6_K", shape, ("Q6_K",))
    n, k = shape
    codes = torch.empty(n, k, dtype=torch.uint8)
    d = torch.empty(n, k // BLOCK, dtype=torch.float16)
    sc = torch.empty(n, k // 16, dtype=torch.int8)
    rc = require_library().sluice_gguf_to_q6_blocks(
        data.ctypes.data,
        n,
        k,
        codes.data_ptr(),
        d.data_ptr(),
        sc.data_ptr(),
        torch.get_num_threads(),
    )
    if rc != 0:
        raise ValueError(f"K = {k} does not split into Q6_K blocks")
    return codes, d, sc


def gguf_rows(
    raw: np.ndarray, type_name: str, shape: tuple[int, int], ids: torch.Tensor
) -> torch.Tensor:
    """Rows `ids` of a [N, K] tensor stored as `type_name` (one of `INT8_TYPES`), decoded to
    float32 [len(ids), K]: the values numpy's decoders give."""
    data = _bytes_of(raw, type_name, shape, INT8_TYPES)
    n, k = shape
    flat = ids.reshape(-1).to(torch.int64).contiguous()
    out = torch.empty(flat.numel(), k, dtype=torch.float32)
    rc = require_library().sluice_gguf_rows(
        data.ctypes.data,
        TYPE_NUMBERS[type_name],
        n,
        k,
        flat.data_ptr(),
        flat.numel(),
        out.data_ptr(),
    )
    if rc == -2:
        raise IndexError(f"a token id outside [0, {n})")
    if rc != 0:
        raise ValueError(f"K = {k} does not split into {type_name} blocks")
    return out.view(*ids.shape, k)
