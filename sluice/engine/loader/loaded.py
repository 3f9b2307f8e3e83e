"""What loading a model gives (`LoadedModel`): its configuration, HF-named tensors, tokenizer,
and how its file stored them."""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from ..config import ModelConfig
from .gguf_blocks import FLOAT_TYPES, Int4Blocks, StoredRows, WideBlocks

if TYPE_CHECKING:
    from ..tokenizer import Tokenizer


@dataclass
class LoadedModel:
    config: ModelConfig
    # HF names; float32 unless load_model(dtype=...) asked otherwise; a GGUF file's are read when
    # asked for (`lazy_tensors`)
    tensors: MutableMapping[str, torch.Tensor]
    tokenizer: Tokenizer | None  # None only when load_model(load_tokenizer=False)
    source: str  # path it came from
    # the layers' 4-bit matrices as the file's own blocks (`gguf_blocks`), by HF name: int4
    # weights are built from these rather than quantized again from the values
    int4_blocks: Mapping[str, Int4Blocks] = field(default_factory=dict)
    # every matrix of a type the native code reads as int8 blocks (`gguf_to_blocks`), by HF name:
    # int8 weights are built from these without a float copy
    int8_blocks: Mapping[str, WideBlocks] = field(default_factory=dict)
    # the embedding as the file stores it, where its type is one of those (rows looked up in it)
    stored_rows: Mapping[str, StoredRows] = field(default_factory=dict)
    # the GGUF type of each layer matrix, by HF name (empty for other files)
    stored_types: dict[str, str] = field(default_factory=dict)

    @property
    def stored_formats(self) -> tuple[str, ...]:
        """The quantized types the file stored the decoder layers' matrices in (GGUF's, such as
        "Q4_1"), sorted; empty where they were float tensors."""
        return tuple(sorted({t for t in self.stored_types.values() if t not in FLOAT_TYPES}))
