"""What the engine does to a built model's weights (`transform_weights`): quantized to int8 or
int4, packed for oneDNN or for the fixed-order matmul, or left as loaded, into the forms of
`weights`; and `cast_unquantized` for a model quantized from wider weights than it runs in."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING

import torch
from torch import nn

from .errors import ConfigError
from .weights import (
    BlockInt8Embedding,
    BlockInt8Linear,
    Embedding,
    FileEmbedding,
    FixedOrderLinear,
    Int8Embedding,
    Int8Linear,
    Linear,
    PackedLinear,
)

if TYPE_CHECKING:
    from .loader.gguf_blocks import StoredProjections
    from .model import CausalLM, DecoderLayer

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
    if model.config.num_experts:
        # Quantized, each expert's matrices are blocks the native kernels multiply; unquantized,
        # every matrix multiplies as loaded (no packed or fixed-order expert kernel yet).
        if layout == "fixed-order":
            raise ConfigError(
                "deterministic mode has no fixed-order kernel for a mixture of experts yet",
                field="deterministic",
            )
        if quantization is not None and int8_format != "blocks":
            raise ConfigError(
                f"quantization {quantization!r} of a mixture of experts "
                f"({model.config.architecture}) runs on the native CPU kernels only",
                field="quantization",
            )
        if quantization is not None:
            quantize_in_blocks(model, 4 if quantization == "int4" else 8, stored)
        return
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
        if isinstance(module, (Int8Embedding, BlockInt8Embedding, FileEmbedding)):
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


class BlockWeights:
    """How a model's matrices become the native kernels' blocks (`quantize_in_blocks`), each as
    the model builder reaches it (`loader.build_model`, `tensor_names.model_weights`): a quantized
    model never holds the float copy of more than one matrix, and a matrix the file stores in a
    form the kernels read (`stored`) is never made float at all."""

    def __init__(self, bits: int = 8, stored: StoredProjections | None = None):
        from .loader.gguf_blocks import StoredProjections

        self.bits = bits
        self.stored = stored if stored is not None else StoredProjections()

    def projection(
        self, key: tuple[int, str], read: Callable[[], torch.Tensor], bias: torch.Tensor | None
    ) -> nn.Module:
        """A layer's projection (key: layer index and `PROJECTIONS` name) from a function that
        reads its float matrix, and its bias: in 4 bits, from the file's 4-bit blocks where it
        stored them so, and in int8 where it stored a part wider (llama.cpp's mixed files keep
        their most sensitive matrices wider); otherwise in `bits`. Int8 from the file's own
        blocks wherever its types read so, else quantized from `read()`."""
        stored = self.stored
        if self.bits == 4 and key in stored.int4:
            return BlockInt8Linear.from_int4_blocks(stored.int4[key](), bias)
        bits = 8 if key in stored.wider else self.bits
        if bits == 8 and key in stored.int8:
            return BlockInt8Linear.from_int8_blocks(stored.int8[key](), bias)
        return BlockInt8Linear.from_weight(read(), bias, bits)

    def head(self) -> BlockInt8Linear | None:
        """The LM head from the file's blocks (the embedding's, when tied): a Q6_K head's own,
        another type's as int8; None where its type does not read so."""
        if self.stored.head is None:
            return None
        return BlockInt8Linear.from_int8_blocks(self.stored.head(), None)

    def embedding(self, dtype: torch.dtype) -> FileEmbedding | None:
        """An untied embedding left in the file, its rows decoded from the file's blocks when
        looked up, in `dtype`; None where its type does not read so."""
        if self.stored.embed is None:
            return None
        rows = self.stored.embed()
        return FileEmbedding(rows.map(), rows.type_name, rows.shape, dtype)


def quantize_in_blocks(
    model: CausalLM, bits: int = 8, stored: StoredProjections | None = None
) -> None:
    """Codes in blocks of 32 wherever a matrix is multiplied, multiplied as stored by the native
    kernel: the four projections of every layer in `bits` (8 or 4) as `BlockWeights` makes them,
    the LM head in int8 (as GGUF files keep it: the vocabulary matrix is the most sensitive; a
    file's Q6_K head keeps its own blocks). A
    tied head's embedding reads its rows from the head's matrix (`BlockInt8Embedding`); an untied
    one keeps int8 rows with one scale each (`Int8Embedding`). Norm weights stay in the model
    dtype. What the builder already made in blocks stays as it is."""
    from .kernels.int8_linear import quantize_int8 as quantize

    head, embed = model.lm_head, model.embed_tokens
    built_head = isinstance(head, BlockInt8Linear)
    if not (isinstance(head, Linear) or built_head) or not isinstance(
        embed, (Embedding, BlockInt8Embedding, FileEmbedding)
    ):
        raise RuntimeError("quantize before packing: packed weights cannot be quantized")
    weights = BlockWeights(bits, stored)
    for n, layer in enumerate(_layers(model)):
        for name in PROJECTIONS:
            linear = getattr(layer, name)
            if linear is None or isinstance(linear, BlockInt8Linear):  # (None: experts instead)
                continue
            read = partial(getattr, linear.weight, "data")
            setattr(layer, name, weights.projection((n, name), read, linear.bias))
        if layer.experts is not None:  # (those not already made from the file's blocks)
            layer.experts.replace_matrices(partial(_expert_in_blocks, weights, n))
    if not built_head:
        assert isinstance(head, Linear)
        model.lm_head = blocked = BlockInt8Linear.quantize(head)
        if isinstance(embed, Embedding) and head.weight is embed.weight:  # tied
            model.embed_tokens = BlockInt8Embedding(blocked, embed.weight.dtype)
            return
    if isinstance(embed, Embedding):  # untied, and not made by the builder
        dtype = embed.weight.dtype
        model.embed_tokens = Int8Embedding(*quantize(embed.weight.data), dtype)


def _expert_in_blocks(weights: BlockWeights, layer: int, name: str, linear: Linear) -> nn.Module:
    return weights.projection((layer, name), partial(getattr, linear.weight, "data"), linear.bias)


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
