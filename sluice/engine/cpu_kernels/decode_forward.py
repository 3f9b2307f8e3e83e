"""A step of decodes, from token ids to the final norm's output, in one native call
(`sluice_decode_forward` in `decoder_layers.c`): the embedding lookup, the rotary tables' rows,
the layer stack (`LayerStack`) and the final norm, with the kernels the model's forward runs
through the native family, so the same bits. What goes is the Python around the stack: the step
plan, the embedding, the rotary rows, the stack's arguments and the final norm cost a lone
request ~0.4 ms of a ~3.5 ms step (the caches cold after the step's weights streamed through
them), against ~0.05 for the few numpy arrays built here.

    forward = DecodeForward.of(model, stack)    # None where the embedding is not served
    hidden = forward.run(token_ids, seq_lens, block_tables, caches, block_size, window, rope)
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from . import require_library
from .decoder_layers import LayerStack

if TYPE_CHECKING:
    from ..paged_cache import LayerKVCache

# decoder_layers.c's embedding kinds: rows copied from a table in the model's type, dequantized
# from a packed int8 head, or int8 codes times a float32 scale a row
EMBED_TABLE, EMBED_BLOCKS, EMBED_ROWS_INT8 = 0, 1, 2


class _Embedding(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("scales", ctypes.c_void_p),
        ("vocab", ctypes.c_int64),
        ("kind", ctypes.c_int64),
    ]


class DecodeForward:
    """A model's forward for steps of decodes only (one new token a sequence), as one C call."""

    def __init__(self, model: Any, stack: LayerStack, embedding: _Embedding):
        self.model = model  # model.CausalLM
        self.stack = stack
        self.embedding = embedding
        self.dtype = model.dtype

    @classmethod
    def of(cls, model: Any, stack: LayerStack) -> DecodeForward | None:
        """The call for `model` (its layers as `stack`), or None where its embedding is none of
        a table in the model's type, rows of a packed int8 head (`BlockInt8Embedding`) and int8
        rows with a scale each (`Int8Embedding`)."""
        from ..weights import BlockInt8Embedding, Embedding, Int8Embedding

        embed = model.embed_tokens
        if isinstance(embed, BlockInt8Embedding) and embed.dtype == model.dtype:
            packed = embed.packed
            table = _Embedding(packed.data.data_ptr(), None, packed.n, EMBED_BLOCKS)
        elif isinstance(embed, Embedding) and embed.weight.dtype == model.dtype:
            weight = embed.weight
            if not weight.is_contiguous():
                return None
            table = _Embedding(weight.data_ptr(), None, weight.shape[0], EMBED_TABLE)
        elif (
            isinstance(embed, Int8Embedding)
            and embed.dtype == model.dtype
            and embed.qweight.is_contiguous()
            and embed.scale.dtype == torch.float32
            and embed.scale.dim() == 1
            and embed.scale.is_contiguous()
        ):
            codes = embed.qweight
            table = _Embedding(
                codes.data_ptr(), embed.scale.data_ptr(), codes.shape[0], EMBED_ROWS_INT8
            )
        else:
            return None
        return cls(model, stack, table)

    def run(
        self,
        token_ids: Sequence[int],
        seq_lens: Sequence[int],
        block_tables: Sequence[Sequence[int]],
        caches: Sequence[LayerKVCache],
        block_size: int,
        window: int | None,
        rope: tuple[torch.Tensor, torch.Tensor],
    ) -> torch.Tensor:
        """Sequence i's new token token_ids[i] at position seq_lens[i] - 1, its context in the
        blocks block_tables[i]; rope: the float32 cos and sin tables [positions, D/2], positions
        up to max(seq_lens) - 1 included -> final-norm hidden states [n, H]."""
        n = len(token_ids)
        lens = np.array(seq_lens, dtype=np.int32)
        tables = np.zeros((n, max(map(len, block_tables))), dtype=np.int32)
        for i, row in enumerate(block_tables):
            tables[i, : len(row)] = row
        positions = lens.astype(np.int64) - 1
        blocks = tables[np.arange(n), positions // block_size].astype(np.int64)
        slots = blocks * block_size + positions % block_size
        ids = np.array(token_ids, dtype=np.int64)
        rows = np.arange(n, dtype=np.int64)  # decode i is row i of the step

        s = self.stack.step(n, block_size, window, caches[0].k.dtype, self.dtype)
        s.slots = slots.ctypes.data
        s.num_decodes, s.decode_bt_stride, s.max_seq_len = n, tables.shape[1], int(lens.max())
        s.decode_tokens, s.decode_block_tables = rows.ctypes.data, tables.ctypes.data
        s.decode_seq_lens = lens.ctypes.data
        cos, sin = rope
        out = torch.empty(n, self.stack.hidden, dtype=self.dtype)
        rc = require_library().sluice_decode_forward(
            self.stack.layer_table(caches),
            len(self.stack.layers),
            ctypes.byref(s),
            ctypes.byref(self.embedding),
            ids.ctypes.data,
            positions.ctypes.data,
            cos.data_ptr(),
            sin.data_ptr(),
            self.model.norm.data_ptr(),
            out.data_ptr(),
        )
        if rc == -3:
            raise IndexError(f"a token id outside [0, {self.embedding.vocab})")
        if rc == -1:
            raise MemoryError(f"decode forward: no memory for the scratch rows of {n} tokens")
        if rc != 0:
            raise RuntimeError(f"decode forward: a kernel failed with code {rc}")
        return out
