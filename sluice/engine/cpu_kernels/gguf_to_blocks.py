"""A GGUF tensor's blocks as int8 blocks of 32 (`block_int8_linear`'s codes and scales), straight
from the file's bytes by the native code (`gguf_to_blocks.c`): Q8_0 and Q5_0 as stored, Q6_K, Q4_K,
Q4_0 and Q4_1 decoded and quantized by GGUF's Q8_0 rule with the bits of
`block_int8_linear.quantize_blocks` over numpy's decoded values.

    codes, scales = gguf_int8_blocks(raw, "Q6_K", (n, k))   # int8 [N, K], float16 [N, K / 32]
"""

from __future__ import annotations

import numpy as np
import torch

from . import require_library

# GGML's numbers for the types the native code reads
TYPE_NUMBERS = {"Q4_0": 2, "Q4_1": 3, "Q5_0": 6, "Q8_0": 8, "Q4_K": 12, "Q6_K": 14}
INT8_TYPES = tuple(TYPE_NUMBERS)
BLOCK = 32


def gguf_int8_blocks(
    raw: np.ndarray, type_name: str, shape: tuple[int, int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """A [N, K] tensor stored as `type_name` (its bytes, uint8) as int8 codes [N, K] and float16
    scales [N, K / 32]."""
    if type_name not in TYPE_NUMBERS:
        raise ValueError(f"{type_name} is not read as int8 blocks ({', '.join(INT8_TYPES)})")
    n, k = shape
    lib = require_library()
    kind = TYPE_NUMBERS[type_name]
    data = np.ascontiguousarray(raw, dtype=np.uint8).reshape(-1)
    if data.size != n * lib.sluice_gguf_row_bytes(kind, k):
        raise ValueError(f"{data.size} bytes are not a [{n}, {k}] {type_name} tensor")
    codes = torch.empty(n, k, dtype=torch.int8)
    scales = torch.empty(n, k // BLOCK, dtype=torch.float32)
    rc = lib.sluice_gguf_to_int8_blocks(
        data.ctypes.data, kind, n, k, codes.data_ptr(), scales.data_ptr(), torch.get_num_threads()
    )
    if rc != 0:
        raise ValueError(f"K = {k} does not split into {type_name} blocks")
    return codes, scales.to(torch.float16)
