"""The matrices a model multiplies by, in the forms its kernels read, and the transforms between
them, applied to a built model (`transform_weights`).

- `Linear`: a [N, K] weight (and bias) in the model dtype, as loaded;
- `PackedLinear`: the same weight reordered once into oneDNN's blocked layout (CPU);
- `Int8Linear`: weight-only int8, codes per output channel with float32 scales;
- `BlockInt8Linear`: int8 codes in blocks of 32 along K with float16 scales (GGUF's Q8_0),
  multiplied as stored by the native kernel (CPU);
- `FixedOrderLinear`: the weight packed for deterministic mode's fixed-order matmul (CPU);
- `Embedding`, `Int8Embedding`, `BlockInt8Embedding`: the token table, plain, as int8 rows with
  scales, or read from a tied LM head's blocked int8 matrix (one int8 copy serves both).

Each form computes itself with plain torch (`layer(x)`); a kernel family may compute a form its
own way instead (`KernelOps.linear`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from .errors import ConfigError

if TYPE_CHECKING:
    from .loader.gguf_blocks import Int4Blocks, StoredProjections
    from .model import CausalLM, DecoderLayer


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
        from .cpu_kernels import block_int8_linear as blocks

        weight = linear.weight.data
        k = weight.shape[1]
        if bits == 4:
            return cls(blocks.pack_q4_blocks(*blocks.quantize_q4_blocks(weight), k), linear.bias)
        return cls(blocks.pack_blocks(*blocks.quantize_blocks(weight), k), linear.bias)

    @classmethod
    def from_int4_blocks(cls, blocks: Int4Blocks, linear: Linear) -> BlockInt8Linear:
        """The linear's matrix as 4-bit blocks a file stored (the same values, as the file has
        them, rather than quantized again)."""
        from .cpu_kernels import block_int8_linear as packing

        n, k = linear.weight.shape
        if tuple(blocks.codes.shape) != (n, k):
            raise ValueError(
                f"stored blocks of {tuple(blocks.codes.shape)} for a [{n}, {k}] matrix"
            )
        return cls(packing.pack_q4_blocks(blocks.codes, blocks.d, blocks.m, k), linear.bias)

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


PROJECTIONS = ("qkv", "o_proj", "gate_up", "down")  # the Linear modules of a decoder layer


# what `KernelOps.weight_layout` may ask for ("plain": as loaded, for kernels that read them so)
WEIGHT_LAYOUTS = ("onednn", "fixed-order", "plain")
INT8_FORMATS = ("per-channel", "blocks")  # what `KernelOps.int8_format` may ask for


def transform_weights(
    model: CausalLM,
    quantization: str | None,
    layout: str = "onednn",
    int8_format: str = "per-channel",
    stored: StoredProjections | None = None,
) -> None:
    """What the engine does to a built model:
    - "int8" quantizes it per output channel (`quantize_int8`), or in blocks of 32
      (`quantize_in_blocks`) where its kernels read int8 that way;
    - "int4" quantizes it in 4-bit blocks of 32 (the native kernels only), or takes a
      projection's blocks as a file stored them, or int8 blocks where the file stored it wider
      (`stored`);
    - None packs its matmul weights in the layout its kernels read: for oneDNN where that is
      available (`pack_for_onednn`), for the fixed-order matmul (`pack_for_fixed_order`), or not
      at all ("plain")."""
    if layout not in WEIGHT_LAYOUTS:
        raise ValueError(f"unknown weight layout {layout!r}")
    if int8_format not in INT8_FORMATS:
        raise ValueError(f"unknown int8 format {int8_format!r}")
    if quantization == "int4" and int8_format != "blocks":
        raise ConfigError(
            "quantization 'int4' runs on the native CPU kernels only", field="quantization"
        )
    if quantization in ("int8", "int4") and int8_format == "blocks":
        quantize_in_blocks(model, 4 if quantization == "int4" else 8, stored)
    elif quantization == "int8":
        quantize_int8(model)
    elif quantization is None:
        if layout == "fixed-order":
            pack_for_fixed_order(model)
        elif layout == "onednn":
            pack_for_onednn(model)
    else:
        raise ConfigError(f"unsupported quantization {quantization!r}", field="quantization")


def cast_unquantized(model: CausalLM, dtype: torch.dtype) -> None:
    """A model quantized from wider weights than it runs in: its float parameters (norms,
    biases) cast to `dtype`, and the embedding's output and the model's dtype set to it. The
    quantized codes and their float32 scales stay as they are."""
    for p in model.parameters():
        if p.is_floating_point():
            p.data = p.data.to(dtype)
    for module in model.modules():
        if isinstance(module, (Int8Embedding, BlockInt8Embedding)):
            module.dtype = dtype
    model.dtype = dtype


def transform_linear(
    linear: Linear, quantization: str | None, layout: str, int8_format: str = "per-channel"
) -> nn.Module:
    """One matrix in the form `transform_weights` gives a model's projections (what the dtype
    probe times)."""
    if quantization == "int4":
        return BlockInt8Linear.quantize(linear, 4)
    if quantization == "int8":
        return (BlockInt8Linear if int8_format == "blocks" else Int8Linear).quantize(linear)
    if layout == "fixed-order":
        return FixedOrderLinear.pack(linear)
    return PackedLinear.pack(linear) or linear


def _layers(model: CausalLM) -> list[DecoderLayer]:
    return list(model.layers)  # type: ignore[arg-type]  # a ModuleList of DecoderLayers


def quantize_int8(model: CausalLM) -> None:
    """Weight-only int8 wherever a matrix is multiplied: the four projections of every layer and
    the vocabulary matrices. The embedding's rows are the tied LM head's output channels, so one
    int8 copy with per-row scales serves both the lookup and the head. Norm weights stay in the
    model dtype. Replaces oneDNN packing (the two are not combined)."""
    from .kernels.int8_linear import quantize_int8 as quantize

    head, embed = model.lm_head, model.embed_tokens
    if not isinstance(head, Linear) or not isinstance(embed, Embedding):
        raise RuntimeError("quantize before packing: packed weights cannot be quantized")
    for layer in _layers(model):
        for name in PROJECTIONS:
            setattr(layer, name, Int8Linear.quantize(getattr(layer, name)))
    q, scale = quantize(embed.weight.data)
    model.embed_tokens = Int8Embedding(q, scale, embed.weight.dtype)
    tied = head.weight is embed.weight
    model.lm_head = Int8Linear(q, scale, None) if tied else Int8Linear.quantize(head)


def quantize_in_blocks(
    model: CausalLM, bits: int = 8, stored: StoredProjections | None = None
) -> None:
    """Codes in blocks of 32 wherever a matrix is multiplied, multiplied as stored by the native
    kernel: the four projections of every layer in `bits` (8 or 4), the LM head in int8 (as GGUF
    files keep it: the vocabulary matrix is the most sensitive). A tied head's embedding reads its
    rows from the head's matrix (`BlockInt8Embedding`); an untied one keeps int8 rows with one
    scale each (`Int8Embedding`). Norm weights stay in the model dtype. In 4 bits, with a file's
    `stored` layout, a projection it stored in 4 bits takes those blocks as they are, and one it
    stored wider is int8 (llama.cpp's mixed files keep their most sensitive matrices wider)."""
    from .kernels.int8_linear import quantize_int8 as quantize

    head, embed = model.lm_head, model.embed_tokens
    if not isinstance(head, Linear) or not isinstance(embed, Embedding):
        raise RuntimeError("quantize before packing: packed weights cannot be quantized")
    for n, layer in enumerate(_layers(model)):
        for name in PROJECTIONS:
            linear, key = getattr(layer, name), (n, name)
            if bits == 4 and stored is not None and key in stored.int4:
                quantized = BlockInt8Linear.from_int4_blocks(stored.int4[key], linear)
            elif bits == 4 and stored is not None and key in stored.wider:
                quantized = BlockInt8Linear.quantize(linear, 8)
            else:
                quantized = BlockInt8Linear.quantize(linear, bits)
            setattr(layer, name, quantized)
    tied = head.weight is embed.weight
    model.lm_head = blocked = BlockInt8Linear.quantize(head)
    dtype = embed.weight.dtype
    model.embed_tokens = (
        BlockInt8Embedding(blocked, dtype)
        if tied
        else Int8Embedding(*quantize(embed.weight.data), dtype)
    )


def pack_for_fixed_order(model: CausalLM) -> None:
    """Every matmul weight packed for the fixed-order matmul; a tied LM head gets a packed copy
    of its own (the embedding lookup needs the plain matrix)."""
    if not isinstance(model.lm_head, Linear):
        raise RuntimeError(f"cannot pack a {type(model.lm_head).__name__} for the fixed order")
    for layer in _layers(model):
        for name in PROJECTIONS:
            setattr(layer, name, FixedOrderLinear.pack(getattr(layer, name)))
    model.lm_head = FixedOrderLinear.pack(model.lm_head)


def pack_for_onednn(model: CausalLM) -> bool:
    """Hand the matmul weights to oneDNN in its packed layout (CPU only; see PACK_BATCH_HINT).

    A tied LM head gets a packed copy of its own (the embedding lookup needs the plain matrix).
    Returns False, changing nothing, where the packed path is unavailable."""
    if isinstance(model.lm_head, PackedLinear):
        return True
    if not isinstance(model.lm_head, Linear):
        return False  # quantized
    layers = _layers(model)
    head = PackedLinear.pack(model.lm_head)
    first = [PackedLinear.pack(getattr(layers[0], name)) for name in PROJECTIONS]
    if head is None or any(p is None for p in first):
        return False
    for n, layer in enumerate(layers):
        packed = (
            first if n == 0 else [PackedLinear.pack(getattr(layer, name)) for name in PROJECTIONS]
        )
        if any(p is None for p in packed):
            raise RuntimeError("oneDNN packed the first layer's weights but not a later one's")
        for name, p in zip(PROJECTIONS, packed):
            setattr(layer, name, p)
    model.lm_head = head
    return True
