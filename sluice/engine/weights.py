"""The matrices a model multiplies by, in the forms its kernels read (`weight_transforms` turns a
built model's weights from one form into another).

- `Linear`: a [N, K] weight (and bias) in the model dtype, as loaded;
- `PackedLinear`: the same weight reordered once into oneDNN's blocked layout (CPU);
- `Int8Linear`: weight-only int8, codes per output channel with float32 scales;
- `BlockInt8Linear`: int8 codes in blocks of 32 along K with float16 scales (GGUF's Q8_0),
  multiplied as stored by the native kernel (CPU);
- `FixedOrderLinear`: the weight packed for deterministic mode's fixed-order matmul (CPU);
- `Embedding`, `Int8Embedding`, `BlockInt8Embedding`: the token table, plain, as int8 rows with
  scales, or read from a tied LM head's blocked int8 matrix (one int8 copy serves both);
- `FileEmbedding`: an untied token table left in the model file, in its own format, its rows
  decoded when looked up.

Each form computes itself with plain torch (`layer(x)`); a kernel family may compute a form its
own way instead (`KernelOps.linear`).
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:
    from .loader.gguf_blocks import Int4Blocks, WideBlocks


def frozen_parameter(t: torch.Tensor) -> nn.Parameter:
    return t if isinstance(t, nn.Parameter) else nn.Parameter(t, requires_grad=False)


def optional_parameter(t: torch.Tensor | None) -> nn.Parameter | None:
    return None if t is None else frozen_parameter(t)


class Linear(nn.Module):
    weight: nn.Parameter
    bias: nn.Parameter | None

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        self.weight = frozen_parameter(weight)  # a tied head shares the embedding's parameter
        self.bias = optional_parameter(bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


# On the CPU the projection weights are handed to oneDNN once, reordered into its blocked layout
# (`torch.ops.mkldnn._reorder_linear_weight`, what torch.compile's CPU backend does too), and every
# matmul then runs oneDNN's kernel on them. Measured on SmolLM2's shapes (2 cores, AVX-512):
# float32 1.5x faster at 1 row, ~1.5x at 64, ~1.25x at 2048 than F.linear's BLAS call; bfloat16
# ~1.35x at 64 rows. Where the op is missing or disagrees with F.linear, weights stay as they are.
PACK_BATCH_HINT = 64  # the row count oneDNN tunes the layout for (decode batches); any count works


def pack_linear_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """The oneDNN-packed form of a [N, K] weight, or None where that path is not available."""
    if weight.device.type != "cpu" or weight.dtype not in (torch.float32, torch.bfloat16):
        return None
    mkldnn = getattr(torch.ops, "mkldnn", None)
    if not torch.backends.mkldnn.is_available() or mkldnn is None:
        return None
    try:
        packed = mkldnn._reorder_linear_weight(weight, PACK_BATCH_HINT)
        g = torch.Generator().manual_seed(0)
        x = torch.randn(3, weight.shape[1], generator=g).to(weight.dtype)
        got = mkldnn._linear_pointwise(x, packed, None, "none", [], "")
        want = F.linear(x, weight)
        tol = 1e-4 if weight.dtype == torch.float32 else 2e-2
        close = torch.allclose(
            got.float(), want.float(), rtol=tol, atol=tol * want.abs().max().item()
        )
        return packed if got.shape == want.shape and close else None
    except (RuntimeError, AttributeError, NotImplementedError):
        return None


def packed_linear(
    x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x @ W.T (+ bias) for a weight packed by `pack_linear_weight`."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


class PackedLinear(nn.Module):
    packed: torch.Tensor
    bias: nn.Parameter | None

    def __init__(self, packed: torch.Tensor, bias: nn.Parameter | None):
        super().__init__()
        self.register_buffer("packed", packed, persistent=False)
        self.bias = bias

    @classmethod
    def pack(cls, linear: Linear) -> PackedLinear | None:
        """The packed form of `linear`, or None where oneDNN's path is unavailable."""
        packed = pack_linear_weight(linear.weight)
        return None if packed is None else cls(packed, linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return packed_linear(x, self.packed, self.bias)


class Int8Linear(nn.Module):
    """Weight-only int8 (`kernels.int8_linear`): qweight int8 [N, K], scale float32 [N]."""

    qweight: torch.Tensor
    scale: torch.Tensor
    bias: nn.Parameter | None

    def __init__(self, qweight: torch.Tensor, scale: torch.Tensor, bias: nn.Parameter | None):
        super().__init__()
        self.register_buffer("qweight", qweight, persistent=False)
        self.register_buffer("scale", scale, persistent=False)
        self.bias = bias

    @classmethod
    def quantize(cls, linear: Linear) -> Int8Linear:
        from .kernels.int8_linear import quantize_int8

        return cls(*quantize_int8(linear.weight.data), linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from .kernels.int8_linear import int8_linear_torch

        return int8_linear_torch(x, self.qweight, self.scale, self.bias)


class BlockInt8Linear(nn.Module):
    """Int8 (or 4-bit) codes in blocks of 32 along K (`cpu_kernels.block_int8_linear`), packed
    for its kernel."""

    bias: nn.Parameter | None

    def __init__(self, packed, bias: nn.Parameter | None):
        super().__init__()
        self.packed = packed  # a BlockInt8Weight
        self.register_buffer("data", packed.data, persistent=False)  # counted with the weights
        self.bias = bias

    @classmethod
    def quantize(cls, linear: Linear, bits: int = 8) -> BlockInt8Linear:
        return cls.from_weight(linear.weight.data, linear.bias, bits)

    @classmethod
    def from_weight(
        cls, weight: torch.Tensor, bias: torch.Tensor | None, bits: int = 8
    ) -> BlockInt8Linear:
        """A float [N, K] matrix quantized in `bits` (8 or 4)."""
        from .cpu_kernels import block_int8_linear as blocks

        k = weight.shape[1]
        if bits == 4:
            packed = blocks.pack_q4_blocks(*blocks.quantize_q4_blocks(weight), k)
        else:
            packed = blocks.pack_blocks(*blocks.quantize_blocks(weight), k)
        return cls(packed, optional_parameter(bias))

    @classmethod
    def from_int4_blocks(cls, blocks: Int4Blocks, bias: torch.Tensor | None) -> BlockInt8Linear:
        """A matrix as 4-bit blocks a file stored (the same values, as the file has them, rather
        than quantized again)."""
        from .cpu_kernels import block_int8_linear as packing

        k = blocks.codes.shape[1]
        packed = packing.pack_q4_blocks(blocks.codes, blocks.d, blocks.m, k)
        return cls(packed, optional_parameter(bias))

    @classmethod
    def from_int8_blocks(cls, blocks: WideBlocks, bias: torch.Tensor | None) -> BlockInt8Linear:
        """A matrix as int8 blocks read from a file (`gguf_to_blocks`), or as a 5-bit or Q6_K
        tensor's own blocks (`Q5Blocks`, `Q6Blocks`)."""
        from .cpu_kernels import block_int8_linear as packing
        from .loader.gguf_blocks import Q5Blocks, Q6Blocks

        k = blocks.codes.shape[1]
        if isinstance(blocks, Q6Blocks):
            packed = packing.pack_q6_blocks(blocks.codes, blocks.d, blocks.sc, k)
        elif isinstance(blocks, Q5Blocks):
            packed = packing.pack_q5_blocks(blocks.codes, blocks.d, blocks.m, k)
        else:
            packed = packing.pack_blocks(blocks.codes, blocks.d, k)
        return cls(packed, optional_parameter(bias))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from .cpu_kernels.block_int8_linear import block_int8_linear

        return block_int8_linear(x.contiguous(), self.packed, self.bias)


class FixedOrderLinear(nn.Module):
    """A weight packed for `cpu_kernels.fixed_order_linear`: every output element summed in one
    order, whatever the rows in the call (deterministic mode)."""

    bias: nn.Parameter | None

    def __init__(self, packed, bias: nn.Parameter | None):
        super().__init__()
        self.packed = packed  # a FixedOrderWeight
        self.register_buffer("data", packed.data, persistent=False)  # counted with the weights
        self.bias = bias

    @classmethod
    def pack(cls, linear: Linear) -> FixedOrderLinear:
        from .cpu_kernels.fixed_order_linear import pack_fixed_order

        return cls(pack_fixed_order(linear.weight.data), linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from .cpu_kernels.fixed_order_linear import fixed_order_linear

        return fixed_order_linear(x.contiguous(), self.packed, self.bias)


class Embedding(nn.Module):
    weight: nn.Parameter

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.weight = frozen_parameter(weight)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.weight)


class Int8Embedding(nn.Module):
    """Rows of int8 codes with one float32 scale each, returned in `dtype`."""

    qweight: torch.Tensor
    scale: torch.Tensor

    def __init__(self, qweight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype):
        super().__init__()
        self.register_buffer("qweight", qweight, persistent=False)
        self.register_buffer("scale", scale, persistent=False)
        self.dtype = dtype

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        rows = F.embedding(input_ids, self.qweight).to(self.dtype)
        return rows * self.scale[input_ids].unsqueeze(1).to(self.dtype)


class BlockInt8Embedding(nn.Module):
    """Token rows read from a `BlockInt8Linear`'s packed matrix (a tied LM head's), in `dtype`."""

    def __init__(self, head: BlockInt8Linear, dtype: torch.dtype):
        super().__init__()
        self.packed = head.packed
        self.register_buffer("data", head.packed.data, persistent=False)  # the head's, counted once
        self.dtype = dtype

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        from .cpu_kernels.block_int8_linear import block_int8_rows

        return block_int8_rows(self.packed, input_ids, self.dtype)


class FileEmbedding(nn.Module):
    """Token rows decoded from a model file's own blocks when they are looked up
    (`cpu_kernels.gguf_to_blocks.gguf_rows`), returned in `dtype`: the table stays in a memory
    map of its part of the file (`raw`), in the file's format (no packed copy: the 1.5B Qwen
    file's is 131 MiB as stored, 248 MiB as int8 blocks), and only the rows a step reads are paged
    in. Their values are the file's exactly."""

    data: torch.Tensor  # the file's bytes of the table (a view of its map)

    def __init__(self, raw: np.ndarray, type_name: str, shape: tuple[int, int], dtype):
        super().__init__()
        self.raw, self.type_name, self.shape, self.dtype = raw, type_name, shape, dtype
        with warnings.catch_warnings():  # the file's map is read-only, and never written here
            warnings.simplefilter("ignore", UserWarning)
            data = torch.from_numpy(raw)
        self.register_buffer("data", data, persistent=False)  # counted with the weights

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        from .cpu_kernels.gguf_to_blocks import gguf_rows

        return gguf_rows(self.raw, self.type_name, self.shape, input_ids).to(self.dtype)
