"""x @ W.T (+ bias) for quantized weights multiplied as stored (`block_int8_linear.c`): codes in
blocks of 32 along K, activations quantized to int8 per block of 32 in the call, each block's dot
product exact in int32 (AVX512-VNNI or AVX2 where the CPU has them, the same bits without); no
float copy of the weights is ever made. Four weight formats, GGUF's:

- int8 (Q8_0): w = d * q, q in -127..127, one float16 d a block: 8.5 bits a weight;
- int4 (Q4_1): w = d * q + m, q in 0..15, float16 d and m a block: 5 bits a weight;
- 5-bit (Q5_0, Q5_1, Q5_K): w = d * q + m, q in 0..31, float16 d and m a block: 6 bits a weight;
- 6-bit (Q6_K): w = d * sc * (q - 32), q in 0..63, an int8 sc each 16 values and a float16 d each
  256 (packed: 7 bits a weight). Read from a file as stored (`loader.gguf_blocks.Q6Blocks`), never
  made by quantizing here.

    codes, scales = quantize_blocks(weight)    # [N, K] float -> int8 [N, Kp], float16 [N, Kp/32]
    packed = pack_blocks(codes, scales, k)     # panels of 16 columns, as the kernel reads them
    packed4 = pack_q4_blocks(*quantize_q4_blocks(weight), k)
    packed5 = pack_q5_blocks(codes5, d, m, k)  # a 5-bit tensor's own codes, d and m
    packed6 = pack_q6_blocks(codes6, d, sc, k) # a Q6_K tensor's own codes and scales
    y = block_int8_linear(x, packed, bias)     # either format

Kp is K rounded up to a multiple of 32 (the extra codes are zero).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import matmul_operands, require_library

BLOCK = 32  # k of a block
QMAX = 127
DTYPES = (torch.float32, torch.bfloat16)


@dataclass(frozen=True)
class BlockInt8Weight:
    """A [N, K] weight packed for `block_int8_linear` (the layout is the C kernel's)."""

    data: torch.Tensor  # uint8, the packed panels
    n: int
    k: int
    fmt: int = 0  # FMT_Q8, FMT_Q4, FMT_Q6 or FMT_Q5, as the C kernel numbers them


FMT_Q8, FMT_Q4, FMT_Q6, FMT_Q5 = 0, 1, 3, 4
Q4_MAX = 15
Q6_MAX = 63


def blocks_of(k: int) -> int:
    return -(-k // BLOCK)


def _blocks(weight: torch.Tensor) -> torch.Tensor:
    """A [N, K] float weight as float32 blocks [N, Kp / 32, 32], K padded with zeros."""
    if weight.dim() != 2 or not weight.is_floating_point():
        shape = tuple(weight.shape)
        raise ValueError(f"a float [N, K] weight expected, got {shape} {weight.dtype}")
    n, k = weight.shape
    nb = blocks_of(k)
    w = torch.zeros(n, nb * BLOCK, dtype=torch.float32, device=weight.device)
    w[:, :k] = weight.to(torch.float32)
    return w.view(n, nb, BLOCK)


# Rows quantized at a time: a vocabulary matrix (150k rows and more) quantized whole would hold a
# few float32 temporaries of its own size, gigabytes, for the moment it takes.
ROWS_AT_A_TIME = 8192


def _by_rows(quantize, weight: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """`quantize` (row by row independent) over `weight` in slices of rows, joined."""
    if weight.dim() != 2 or weight.shape[0] <= ROWS_AT_A_TIME:
        return quantize(weight)
    parts = [quantize(rows) for rows in weight.split(ROWS_AT_A_TIME)]
    return tuple(torch.cat(p) for p in zip(*parts))


def quantize_blocks(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 codes of a [N, K] float weight, per block of 32 along K, by GGUF's Q8_0 rule
    (llama.cpp's reference quantizer), so a float model quantized here has the codes llama.cpp
    would write: d = absmax / 127 in float32, codes round-half-away(w * (1 / d)), the scale stored
    as float16(d); an all-zero block gets scale 0 and zero codes.
    Returns (codes int8 [N, Kp], scales float16 [N, Kp / 32])."""
    return _by_rows(_quantize_blocks, weight)  # type: ignore[return-value]


def _quantize_blocks(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    blocks = _blocks(weight)
    n = blocks.shape[0]
    d = blocks.abs().amax(dim=2, keepdim=True) / QMAX
    inv = torch.where(d > 0, 1.0 / torch.where(d > 0, d, 1.0), 0.0)
    x = blocks * inv
    codes = torch.sign(x) * torch.floor(x.abs() + 0.5)  # C's roundf: ties away from zero
    codes = codes.clamp_(-QMAX, QMAX).to(torch.int8).view(n, -1)
    return codes, d.squeeze(2).to(torch.float16)


def dequantize_blocks(codes: torch.Tensor, scales: torch.Tensor, k: int) -> torch.Tensor:
    """The float32 [N, K] weight that int8 codes and block scales stand for."""
    n = codes.shape[0]
    w = codes.to(torch.float32).view(n, -1, BLOCK) * scales.to(torch.float32).unsqueeze(2)
    return w.view(n, -1)[:, :k]


def quantize_q4_blocks(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """4-bit codes of a [N, K] float weight, per block of 32 along K, by GGUF's Q4_1 rule
    (llama.cpp's reference quantizer): m = the block's minimum, d = (max - m) / 15 in float32,
    codes min(15, floor((w - m) * (1 / d) + 0.5)); d and m stored as float16.
    Returns (codes uint8 [N, Kp] in 0..15, d float16 [N, Kp / 32], m float16 [N, Kp / 32])."""
    return _by_rows(_quantize_q4_blocks, weight)  # type: ignore[return-value]


def _quantize_q4_blocks(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    blocks = _blocks(weight)
    n = blocks.shape[0]
    lo = blocks.amin(dim=2, keepdim=True)
    d = (blocks.amax(dim=2, keepdim=True) - lo) / Q4_MAX
    inv = torch.where(d > 0, 1.0 / torch.where(d > 0, d, 1.0), 0.0)
    codes = torch.floor((blocks - lo) * inv + 0.5).clamp_(0, Q4_MAX).to(torch.uint8)
    half = torch.float16
    return codes.view(n, -1), d.squeeze(2).to(half), lo.squeeze(2).to(half)


def dequantize_q4_blocks(codes, d, m, k: int) -> torch.Tensor:
    """The float32 [N, K] weight that 4-bit (or 5-bit) codes with block scales and minimums stand
    for."""
    n = codes.shape[0]
    w = codes.to(torch.float32).view(n, -1, BLOCK) * d.to(torch.float32).unsqueeze(2)
    return (w + m.to(torch.float32).unsqueeze(2)).view(n, -1)[:, :k]


def pack_q4_blocks(
    codes: torch.Tensor, d: torch.Tensor, m: torch.Tensor, k: int
) -> BlockInt8Weight:
    """4-bit codes uint8 [N, Kp] and d, m float16 [N, Kp / 32] (`quantize_q4_blocks`) packed for
    the kernel."""
    return _pack_dm(codes, d, m, k, FMT_Q4)


def pack_q5_blocks(
    codes: torch.Tensor, d: torch.Tensor, m: torch.Tensor, k: int
) -> BlockInt8Weight:
    """5-bit codes uint8 [N, Kp] (0..31) and d, m float16 [N, Kp / 32] (a GGUF tensor's own:
    `gguf_to_blocks.gguf_q5_blocks`) packed for the kernel."""
    return _pack_dm(codes, d, m, k, FMT_Q5)


def _expect(k: int, **operands: tuple[torch.Tensor, torch.dtype, int]) -> None:
    """Each packer operand `name=(tensor, dtype, columns per block of 32)` as [N, that x Kp / 32]
    of that dtype, N the first operand's rows (a ValueError naming the first that is not)."""
    n, nb = next(iter(operands.values()))[0].shape[0], blocks_of(k)
    for name, (t, dtype, per_block) in operands.items():
        if t.dtype != dtype or t.shape != (n, per_block * nb) or k < 1:
            want = f"{str(dtype).removeprefix('torch.')} [{n}, {per_block * nb}]"
            raise ValueError(f"{name}: {want} expected, got {t.dtype} {tuple(t.shape)}")


def _pack_dm(codes, d, m, k: int, fmt: int) -> BlockInt8Weight:
    n = codes.shape[0]
    _expect(k, codes=(codes, torch.uint8, BLOCK), d=(d, torch.float16, 1), m=(m, torch.float16, 1))
    lib = require_library()
    size, pack = (
        (lib.sluice_block_q5_packed_bytes, lib.sluice_block_q5_pack)
        if fmt == FMT_Q5
        else (lib.sluice_block_int4_packed_bytes, lib.sluice_block_int4_pack)
    )
    data = torch.empty(size(n, k), dtype=torch.uint8)
    c, dd, mm = codes.contiguous(), d.contiguous(), m.contiguous()
    pack(c.data_ptr(), dd.data_ptr(), mm.data_ptr(), n, k, data.data_ptr())
    return BlockInt8Weight(data, n, k, fmt)


def pack_q6_blocks(
    codes: torch.Tensor, d: torch.Tensor, sc: torch.Tensor, k: int
) -> BlockInt8Weight:
    """6-bit codes uint8 [N, Kp] (0..63, w = d sc (q - 32)), d float16 [N, Kp / 32] (each block's
    super-block's) and sc int8 [N, Kp / 16] packed for the kernel."""
    n = codes.shape[0]
    _expect(k, codes=(codes, torch.uint8, BLOCK), d=(d, torch.float16, 1), sc=(sc, torch.int8, 2))
    lib = require_library()
    data = torch.empty(lib.sluice_block_q6_packed_bytes(n, k), dtype=torch.uint8)
    c, dd, ss = codes.contiguous(), d.contiguous(), sc.contiguous()
    lib.sluice_block_q6_pack(c.data_ptr(), dd.data_ptr(), ss.data_ptr(), n, k, data.data_ptr())
    return BlockInt8Weight(data, n, k, FMT_Q6)


def dequantize_q6_blocks(codes, d, sc, k: int) -> torch.Tensor:
    """The float32 [N, K] weight that 6-bit codes with their scales stand for."""
    n = codes.shape[0]
    q = codes.to(torch.int32).view(n, -1, BLOCK // 2) - 32
    w = (q * sc.to(torch.int32).unsqueeze(2)).view(n, -1, BLOCK).to(torch.float32)
    return (w * d.to(torch.float32).unsqueeze(2)).view(n, -1)[:, :k]


def pack_blocks(codes: torch.Tensor, scales: torch.Tensor, k: int) -> BlockInt8Weight:
    """Codes int8 [N, Kp] and scales float16 [N, Kp / 32] (`quantize_blocks`, or a GGUF Q8_0
    tensor's own) packed for the kernel."""
    n = codes.shape[0]
    _expect(k, codes=(codes, torch.int8, BLOCK), scales=(scales, torch.float16, 1))
    if codes.device.type != "cpu":
        raise ValueError(f"a CPU weight expected, got one on {codes.device}")
    lib = require_library()
    data = torch.empty(lib.sluice_block_int8_packed_bytes(n, k), dtype=torch.uint8)
    c, s = codes.contiguous(), scales.contiguous()
    lib.sluice_block_int8_pack(c.data_ptr(), s.data_ptr(), n, k, data.data_ptr())
    return BlockInt8Weight(data, n, k)


def block_int8_rows(weight: BlockInt8Weight, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows `ids` of a packed weight (any format), dequantized, [len(ids), K] in `dtype` (float32
    or bfloat16): an embedding lookup on the packed matrix of a tied LM head."""
    if dtype not in DTYPES:
        raise ValueError(f"float32 or bfloat16 rows only, not {dtype}")
    flat = ids.reshape(-1).to(torch.int64).contiguous()
    out = torch.empty(flat.numel(), weight.k, dtype=dtype)
    rc = require_library().sluice_block_int8_rows(
        weight.data.data_ptr(),
        weight.n,
        weight.k,
        weight.fmt,
        flat.data_ptr(),
        flat.numel(),
        out.data_ptr(),
        int(dtype == torch.bfloat16),
    )
    if rc != 0:
        raise IndexError(f"a token id outside [0, {weight.n})")
    return out.view(*ids.shape, weight.k)


def widen_blocks(weight: BlockInt8Weight, dtype: torch.dtype) -> torch.Tensor:
    """The whole weight dequantized, [N, K] in `dtype` (float32 or bfloat16): the values its codes
    stand for (`dequantize_blocks`, `dequantize_q4_blocks` for 4 and 5 bits,
    `dequantize_q6_blocks`), bfloat16
    rounded once. For a step with
    enough rows that a float matmul on this copy beats `block_int8_linear` (`NativeOps`)."""
    if dtype not in DTYPES:
        raise ValueError(f"float32 or bfloat16 only, not {dtype}")
    out = torch.empty(weight.n, weight.k, dtype=dtype)
    require_library().sluice_block_widen(
        weight.data.data_ptr(),
        weight.n,
        weight.k,
        weight.fmt,
        out.data_ptr(),
        int(dtype == torch.bfloat16),
        torch.get_num_threads(),
    )
    return out


DOT_PATHS = ("portable", "avx2", "avx512-vnni")  # as sluice_block_int8_dot_path numbers them


def dot_path() -> str:
    """The instructions the loaded kernels take the blocks' dot products with (all give the same
    bits): "avx512-vnni", "avx2", or "portable" C."""
    return DOT_PATHS[require_library().sluice_block_int8_dot_path()]


def has_vnni() -> bool:
    """Whether the loaded kernels multiply with AVX512-VNNI."""
    return dot_path() == "avx512-vnni"


def block_int8_linear(
    x: torch.Tensor, weight: BlockInt8Weight, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x [M, K] (float32 or bfloat16) @ W.T (+ bias [N]) -> [M, N] in x's dtype."""
    if x.dtype not in DTYPES:
        raise ValueError(f"x must be float32 or bfloat16, got {x.dtype}")
    bias = matmul_operands(x, bias, weight.n, weight.k)
    m = x.shape[0]
    out = torch.empty(m, weight.n, dtype=x.dtype)
    rc = require_library().sluice_block_int8_linear(
        x.data_ptr(),
        x.stride(0),
        weight.data.data_ptr(),
        None if bias is None else bias.data_ptr(),
        out.data_ptr(),
        out.stride(0),
        m,
        weight.n,
        weight.k,
        int(x.dtype == torch.bfloat16),
        weight.fmt,
        torch.get_num_threads(),
    )
    if rc == -1:
        raise MemoryError(f"block_int8_linear: no memory for {m} quantized rows")
    if rc != 0:
        shapes = f"{tuple(x.shape)} x {(weight.n, weight.k)}"
        raise ValueError(f"block_int8_linear does not take {shapes}")
    return out
