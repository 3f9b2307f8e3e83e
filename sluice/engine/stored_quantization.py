"""`quantization="auto"` (the CLI's default): a file's quantized matrices run quantized, in the
narrowest of the engine's formats that holds what the file stores, as a llama.cpp user expects
of a GGUF; float files run unquantized.

    choice = quantization_as_stored(("Q4_1",), ops)   # -> StoredChoice("int4", "...")
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .kernel_ops import KernelOps

# GGUF types whose values int4 blocks hold (a scale and a minimum per block of 32 or finer)
FOUR_BIT_FORMATS = frozenset({"Q4_0", "Q4_1", "Q4_K"})


@dataclass(frozen=True)
class StoredChoice:
    quantization: str | None  # what the engine runs: "int4", "int8", or None (unquantized)
    reason: str  # for the start log


def quantization_as_stored(formats: tuple[str, ...], ops: KernelOps) -> StoredChoice:
    """The quantization for a model whose decoder layers the file stored as `formats` (GGUF
    type names; empty for float tensors), on the kernel family `ops`."""
    if not formats:
        return StoredChoice(None, "the file stores its layers' matrices as floats")
    stored = "/".join(formats)
    if ops.int8_format != "blocks":
        # only the block kernels multiply the codes as stored; anything else would quantize
        # the file's values again in a form of its own
        return StoredChoice(
            None,
            f"the file stores them as {stored}, but the {ops.name} kernels do not multiply "
            "quantized blocks: dequantized",
        )
    if set(formats) <= FOUR_BIT_FORMATS and "int4" in ops.quantizations:
        return StoredChoice("int4", f"the file stores its layers' matrices as {stored}")
    if "int8" in ops.quantizations:
        wider = sorted(set(formats) - FOUR_BIT_FORMATS)
        why = f"the file stores its layers' matrices as {stored}" + (
            f"; {'/'.join(wider)} needs more than 4 bits, so every layer runs in int8"
            if wider and len(wider) < len(formats)
            else ""
        )
        return StoredChoice("int8", why)
    return StoredChoice(None, f"the {ops.name} kernels run no quantized weights: dequantized")
