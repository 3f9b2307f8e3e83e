"""A step of decodes, from token ids to the final norm's output, in one native call
(`sluice_decode_forward` in `decoder_layers.c`): the embedding lookup, the rotary tables' rows,
the layer stack (`LayerStack`), the final norm and, where it is packed for C, the LM head, with
the kernels the model's forward runs through the native family, so the same bits. What goes is
the Python around the stack: the step plan, the embedding, the rotary rows, the stack's
arguments, the final norm and the LM head's call cost a lone request ~0.4 ms of a ~3.5 ms step
(the caches cold after the step's weights streamed through them), against ~0.05 for the few
arrays built here.

    forward = DecodeForward(model, stack, rows)    # rows: the embedding (`EmbeddingRows`)
    hidden = forward.run(token_ids, seq_lens, block_tables, caches, block_size, window, rope)
    logits = forward.run(..., logits=True)      # the LM head too, where it is packed for C
"""

from __future__ import annotations

import ctypes
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from . import require_library
from .decoder_layers import LayerStack, c_weight

if TYPE_CHECKING:
    from ..paged_cache import LayerKVCache

# decoder_layers.c's embedding kinds: rows copied from a table in the model's type, dequantized
# from a packed int8 head, int8 codes times a float32 scale a row, or decoded from a GGUF
# tensor's own blocks
EMBED_TABLE, EMBED_BLOCKS, EMBED_ROWS_INT8, EMBED_FILE = 0, 1, 2, 3


def _address(a: array) -> int:
    return a.buffer_info()[0]


class _Embedding(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("scales", ctypes.c_void_p),
        ("vocab", ctypes.c_int64),
        ("kind", ctypes.c_int64),
        ("file_type", ctypes.c_int64),
    ]


@dataclass(frozen=True)
class EmbeddingRows:
    """The token table as the C call reads it: `kind` one of EMBED_*; `data` the rows in the
    model's type, a packed head's blocks, int8 codes, or a GGUF tensor's bytes; `scales`
    float32, one a row (int8 codes only); `vocab` rows; `file_type` GGML's number of the GGUF
    tensor's type (EMBED_FILE), or the packed head's block format (EMBED_BLOCKS)."""

    kind: int
    data: torch.Tensor
    scales: torch.Tensor | None
    vocab: int
    file_type: int = 0


class DecodeForward:
    """A model's forward for steps of decodes only (one new token a sequence), as one C call."""

    def __init__(self, model: Any, stack: LayerStack, rows: EmbeddingRows):
        if not rows.data.is_contiguous() or (
            rows.scales is not None and not rows.scales.is_contiguous()
        ):
            raise ValueError("the embedding's rows must be contiguous")
        self.model = model  # model.CausalLM
        self.stack = stack
        self.rows = rows  # (keeps the tensors the C table points into)
        self.embedding = _Embedding(
            rows.data.data_ptr(),
            None if rows.scales is None else rows.scales.data_ptr(),
            rows.vocab,
            rows.kind,
            rows.file_type,
        )
        self.dtype = model.dtype
        # the LM head as the C call takes it and its rows; None: not packed for a C kernel
        self.head = c_weight(model.lm_head)
        self.vocab = model.lm_head.packed.n if self.head is not None else 0

    def run(
        self,
        token_ids: Sequence[int],
        seq_lens: Sequence[int],
        block_tables: Sequence[Sequence[int]],
        caches: Sequence[LayerKVCache],
        block_size: int,
        window: int | None,
        rope: tuple[torch.Tensor, torch.Tensor],
        logits: bool = False,
    ) -> torch.Tensor:
        """Sequence i's new token token_ids[i] at position seq_lens[i] - 1, its context in the
        blocks block_tables[i]; rope: the float32 cos and sin tables [positions, D/2], positions
        up to max(seq_lens) - 1 included -> final-norm hidden states [n, H]; with `logits` (where
        `head` is not None), the LM head's output [n, V] in the model's type instead."""
        if logits and self.head is None:
            raise ValueError("this model's LM head is not packed for a C kernel")
        # plain lists into C arrays (`array`): at a few sequences, several times cheaper than
        # numpy's small-array operations, and no slower where the step is large
        n = len(token_ids)
        width = max(map(len, block_tables))
        positions = [length - 1 for length in seq_lens]
        slots = array(
            "q",
            (
                row[p // block_size] * block_size + p % block_size
                for row, p in zip(block_tables, positions)
            ),
        )
        tables = array("i")
        for row in block_tables:
            tables.extend(row)
            tables.extend([0] * (width - len(row)))
        lens = array("i", seq_lens)
        positions_c, ids = array("q", positions), array("q", token_ids)
        rows = array("q", range(n))  # decode i is row i of the step

        s = self.stack.step(n, block_size, window, caches[0].k.dtype, self.dtype)
        s.slots = _address(slots)
        s.num_decodes, s.decode_bt_stride, s.max_seq_len = n, width, max(seq_lens)
        s.decode_tokens, s.decode_block_tables = _address(rows), _address(tables)
        s.decode_seq_lens = _address(lens)
        cos, sin = rope
        out = torch.empty(n, self.stack.hidden, dtype=self.dtype)
        head, head_out = None, None
        if logits and self.head is not None:
            head, head_out = ctypes.byref(self.head), torch.empty(n, self.vocab, dtype=self.dtype)
        rc = require_library().sluice_decode_forward(
            self.stack.layer_table(caches),
            len(self.stack.layers),
            ctypes.byref(s),
            ctypes.byref(self.embedding),
            _address(ids),
            _address(positions_c),
            cos.data_ptr(),
            sin.data_ptr(),
            self.model.norm.data_ptr(),
            out.data_ptr(),
            head,
            self.vocab,
            head_out.data_ptr() if head_out is not None else None,
        )
        if rc == -3:
            raise IndexError(f"a token id outside [0, {self.embedding.vocab})")
        if rc == -1:
            raise MemoryError(f"decode forward: no memory for the scratch rows of {n} tokens")
        if rc != 0:
            raise RuntimeError(f"decode forward: a kernel failed with code {rc}")
        return out if head_out is None else head_out
