"""A step's decoder layers in one native call (`decoder_layers.c`), for a model whose matmul
weights are all packed for the library's own kernels (int8 or int4 blocks, or fixed-order).

The call runs, layer after layer, the same kernels with the same arguments as the layer-by-layer
path of the native family (`model.DecoderLayer.forward` over `NativeOps`), so it gives the same
bits; it only saves the ~10 Python calls a layer, which at batch 1 cost as much as the arithmetic.

    stack = LayerStack.of(model.layers)        # None where some weight is not packed for C
    x, residual = stack.run(x, plan, caches, rope_tables)   # the stack's input is x alone
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from . import require_library
from .attention_args import CACHE_KINDS
from .block_int8_linear import BlockInt8Weight
from .fixed_order_linear import FixedOrderWeight

if TYPE_CHECKING:
    from ..paged_cache import LayerKVCache
    from ..step_plan import StepPlan

W_FIXED_ORDER = 2  # decoder_layers.c's weight kinds; block weights use their own fmt (0, 1 or 3)
_ptr, _i64, _i32, _f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32, ctypes.c_float


class _Weight(ctypes.Structure):
    _fields_ = [("data", _ptr), ("bias", _ptr), ("kind", _i64)]


class _Layer(ctypes.Structure):
    _fields_ = [
        ("input_norm", _ptr),
        ("post_norm", _ptr),
        ("qkv", _Weight),
        ("o", _Weight),
        ("gate_up", _Weight),
        ("down", _Weight),
        ("k_cache", _ptr),
        ("v_cache", _ptr),
        ("k_scale", _ptr),
        ("v_scale", _ptr),
    ]


class _Step(ctypes.Structure):
    _fields_ = [
        *((name, _i64) for name in ("rows", "hidden", "heads", "kv_heads", "head_dim", "inter")),
        ("block_size", _i64),
        ("eps", _f32),
        ("scale", _f32),
        *((name, _i32) for name in ("window", "cache_kind", "bf16", "num_threads")),
        ("cos", _ptr),
        ("sin", _ptr),
        ("slots", _ptr),
        ("num_decodes", _i64),
        ("decode_bt_stride", _i64),
        ("max_seq_len", _i64),
        ("decode_tokens", _ptr),
        ("decode_block_tables", _ptr),
        ("decode_seq_lens", _ptr),
        ("num_prefills", _i64),
        ("prefill_bt_stride", _i64),
        ("prefill_starts", _ptr),
        ("prefill_q_lens", _ptr),
        ("prefill_seq_lens", _ptr),
        ("prefill_block_tables", _ptr),
    ]


def c_weight(layer: torch.nn.Module) -> _Weight | None:
    """A linear layer's weight as the C call takes it; None where it is not packed for C."""
    packed = getattr(layer, "packed", None)
    bias = getattr(layer, "bias", None)
    if isinstance(packed, BlockInt8Weight):
        kind = packed.fmt
    elif isinstance(packed, FixedOrderWeight):
        kind = W_FIXED_ORDER
    else:
        return None
    return _Weight(packed.data.data_ptr(), None if bias is None else bias.data_ptr(), kind)


class LayerStack:
    """A model's decoder layers (`model.DecoderLayer`) as one native call."""

    def __init__(self, layers: list[Any], weights: list[tuple[_Weight, ...]]):
        first = layers[0]
        self.layers = layers  # model.DecoderLayer
        self.weights = weights  # per layer: qkv, o, gate_up, down
        self.hq, self.hkv, self.d = first.hq, first.hkv, first.d
        self.hidden = first.input_norm.shape[0]
        self.inter = first.down.packed.k
        self.eps, self.scale = first.eps, first.scale
        self._table: tuple[tuple[int, ...], ctypes.Array] | None = None  # by the caches' addresses

    @classmethod
    def of(cls, layers: Iterable[Any]) -> LayerStack | None:
        """The stack, or None where some layer's matmul weight is not packed for a C kernel."""
        layers, weights = list(layers), []
        for layer in layers:
            parts = [c_weight(m) for m in (layer.qkv, layer.o_proj, layer.gate_up, layer.down)]
            packed = tuple(w for w in parts if w is not None)
            if len(packed) < len(parts):
                return None
            weights.append(packed)
        return cls(layers, weights) if weights else None

    def layer_table(self, caches: Sequence[LayerKVCache]) -> ctypes.Array:
        """The C layer table; its cache pointers are rebuilt only if the caches moved."""
        key = tuple(c.k.data_ptr() for c in caches)
        if self._table is not None and self._table[0] == key:
            return self._table[1]
        table = (_Layer * len(self.layers))()
        for entry, layer, (qkv, o, gate_up, down), cache in zip(
            table, self.layers, self.weights, caches
        ):
            entry.input_norm = layer.input_norm.data_ptr()
            entry.post_norm = layer.post_attention_norm.data_ptr()
            entry.qkv, entry.o, entry.gate_up, entry.down = qkv, o, gate_up, down
            entry.k_cache, entry.v_cache = cache.k.data_ptr(), cache.v.data_ptr()
            quantized = cache.k_scale is not None and cache.v_scale is not None
            entry.k_scale = cache.k_scale.data_ptr() if quantized else None  # type: ignore[union-attr]
            entry.v_scale = cache.v_scale.data_ptr() if quantized else None  # type: ignore[union-attr]
        self._table = (key, table)
        return table

    def step(
        self,
        rows: int,
        block_size: int,
        window: int | None,
        cache_dtype: torch.dtype,
        dtype: torch.dtype,
    ) -> _Step:
        """The C step structure for `rows` tokens, its shapes filled in; the caller adds the rotary
        tables, the slots and the attention rows."""
        return _Step(
            rows=rows,
            hidden=self.hidden,
            heads=self.hq,
            kv_heads=self.hkv,
            head_dim=self.d,
            inter=self.inter,
            block_size=block_size,
            eps=self.eps,
            scale=self.scale,
            window=window or 0,
            cache_kind=CACHE_KINDS[cache_dtype],
            bf16=int(dtype == torch.bfloat16),
            num_threads=torch.get_num_threads(),
        )

    def run(
        self,
        x: torch.Tensor,
        plan: StepPlan,
        caches: Sequence[LayerKVCache],
        rope: tuple[torch.Tensor, torch.Tensor],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H], the first layer's input -> the last layer's (x, residual), as the layers one
        by one give them; `plan` planned by the native family with both its attention kernels
        serving it."""
        t = x.shape[0]
        x = x.contiguous()
        cos, sin = (r.reshape(t, -1).to(torch.float32).contiguous() for r in rope)
        slots = plan.slot_mapping.to(torch.int64).contiguous()
        s = self.step(t, plan.block_size, plan.sliding_window, caches[0].k.dtype, x.dtype)
        s.cos, s.sin, s.slots = cos.data_ptr(), sin.data_ptr(), slots.data_ptr()
        keep = [cos, sin, slots]  # alive until the call returns
        if (d := plan.decodes) is not None:
            bt, lens, tokens = (a.contiguous() for a in (d.block_tables, d.seq_lens, d.tokens))
            keep += [bt, lens, tokens]
            s.num_decodes, s.decode_bt_stride, s.max_seq_len = (
                tokens.shape[0],
                bt.stride(0),
                d.max_seq_len,
            )
            s.decode_tokens, s.decode_block_tables = tokens.data_ptr(), bt.data_ptr()
            s.decode_seq_lens = lens.data_ptr()
        if (p := plan.prefills) is not None:
            arrays = (p.starts, p.q_lens, p.seq_lens, p.block_tables)
            starts, q_lens, lens, bt = (a.contiguous() for a in arrays)
            keep += [starts, q_lens, lens, bt]
            s.num_prefills, s.prefill_bt_stride = starts.shape[0], bt.stride(0)
            s.prefill_starts, s.prefill_q_lens = starts.data_ptr(), q_lens.data_ptr()
            s.prefill_seq_lens, s.prefill_block_tables = lens.data_ptr(), bt.data_ptr()
        x_out, res_out = torch.empty_like(x), torch.empty_like(x)
        rc = require_library().sluice_decoder_layers(
            self.layer_table(caches),
            len(self.layers),
            ctypes.byref(s),
            x.data_ptr(),
            None,  # no residual: the stack's input is x alone
            x_out.data_ptr(),
            res_out.data_ptr(),
        )
        if rc == -1:
            raise MemoryError(f"decoder layers: no memory for the scratch rows of {t} tokens")
        if rc != 0:
            raise RuntimeError(f"decoder layers: a kernel failed with code {rc}")
        return x_out, res_out
