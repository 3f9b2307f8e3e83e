"""`quantization="auto"` (the CLI's default): a file's quantized matrices run quantized, each in
the narrowest of the engine's formats that holds what the file stores (int4 weights keep the
matrices a file stores wider as Q6_K blocks or int8: `weight_transforms.quantize_in_blocks`), as a
llama.cpp user expects of a GGUF; float files run unquantized.

    choice = quantization_as_stored(("Q4_1",), ops)   # -> StoredChoice("int4", "...")
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from .loader.gguf_blocks import FOUR_BIT_TYPES

if TYPE_CHECKING:
    from .kernel_ops.base import KernelOps


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
    if set(formats) & set(FOUR_BIT_TYPES) and "int4" in ops.quantizations:
        kept = sorted(set(formats) & {"Q5_0", "Q5_1", "Q5_K", "Q6_K"})
        wider = sorted(set(formats) - set(FOUR_BIT_TYPES) - set(kept))
        keep = (
            f"; {'/'.join(kept)} matrices keep their blocks (int8 beside 4-bit ones in a fused "
            "projection)"
            if kept
            else ""
        )
        keep += f"; the matrices stored as {'/'.join(wider)} run int8" if wider else ""
        return StoredChoice("int4", f"the file stores its layers' matrices as {stored}{keep}")
    if "int8" in ops.quantizations:
        return StoredChoice("int8", f"the file stores its layers' matrices as {stored}")
    return StoredChoice(None, f"the {ops.name} kernels run no quantized weights: dequantized")
