"""Rounding float32 to a narrower float inside a kernel, the same on the GPU and in the interpreter.

Triton's CPU interpreter truncates float32 -> bfloat16 casts where the compiled cast rounds to
nearest even. Rounding on the bits first leaves a value the cast keeps exactly on both, so the
kernels match torch bit for bit in the tests and in production alike.
"""

from sluice.engine.kernels._triton import tl, triton


@triton.jit
def round_to(x, dtype: tl.constexpr):
    """float32 -> the nearest `dtype` value (ties to even), still held in float32."""
    if dtype == tl.bfloat16:
        bits = x.to(tl.int32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
        x = tl.where(x != x, x, bits.to(tl.float32, bitcast=True))
    elif dtype != tl.float32:
        x = x.to(dtype).to(tl.float32)
    return x


@triton.jit
def to_dtype(x, dtype: tl.constexpr):
    """float32 -> `dtype`, ties to even."""
    return round_to(x, dtype).to(dtype)
