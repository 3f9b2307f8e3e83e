"""The native family (the CPU default where a C compiler built them): the C kernels of
`cpu_kernels` for the KV write, decode and prefill attention on the cache in place (float32 or
bfloat16 models, on a cache of the model's type or an int8 one, read directly), RMSNorm with the
residual add, rotary (cos and sin from a table: `ChunkedRope`) and SiLU-and-multiply, int8
weights multiplied as stored (`block_int8_linear`); torch (oneDNN) for the float matmuls, and the
sampler. Where every matmul weight is packed for a C kernel (int8 or int4 weights), a step's whole
stack of layers is one C call (`decoder_layers`: the same kernels, the same bits, no Python
between them), and a step of decodes only is one C call from token ids to the final norm, or to
the logits (`forward_decodes`: the embedding, the rotary rows, the final norm and the LM head
too). A step with enough rows may widen a quantized weight to bfloat16 for a oneDNN matmul
instead, where the engine measured that faster (`widen_rows`, `widen_probe`).

Where the attention kernels do not serve a model's shapes (`c_attention_served`), its attention
takes the torch family's path; prefill chunks go through SDPA where only the prefill kernel lacks
the shape.
"""

from __future__ import annotations

import functools
from dataclasses import replace

import torch
import torch.nn.functional as F

from ..cpu_kernels import kv_write, paged_decode, paged_prefill
from ..cpu_kernels.block_int8_linear import BlockInt8Weight, widen_blocks
from ..cpu_kernels.decode_forward import DecodeForward
from ..cpu_kernels.decoder_layers import LayerStack
from ..cpu_kernels.layer_ops import add_rmsnorm_native, rotary_native_, silu_and_mul_native
from ..paged_cache import LayerKVCache
from ..step_plan import AttentionSpec, StepPlan, decode_rows, prefill_rows
from .base import RopeTables
from .chunked_rope import ChunkedRope
from .torch_ops import TorchOps, plan_sdpa_prefills, sdpa_prefills


@functools.cache
def c_attention_served(spec: AttentionSpec) -> tuple[bool, bool]:
    """(the C kernels write this cache and attend on it, the prefill kernel serves it too), by
    the kernels' own rules (`supports`) applied to empty tensors of the spec's types and shapes."""
    q = torch.empty((0, spec.num_heads, spec.head_dim), dtype=spec.dtype, device=spec.device_type)
    cache = torch.empty(
        (0, spec.num_kv_heads, spec.block_size, spec.head_dim),
        dtype=spec.cache_dtype,
        device=spec.device_type,
    )
    served = paged_decode.supports(q, cache) and kv_write.supports(q, cache)
    return served, served and paged_prefill.supports(q, cache)


class NativeOps(ChunkedRope, TorchOps):
    name = "native"
    int8_format = "blocks"  # multiplied as stored by `cpu_kernels.block_int8_linear`
    runs_native_code = True
    measures_widening = True

    def __init__(self) -> None:
        super().__init__()
        # by id of the model's layer list: its layers as one C call, or None where they cannot be
        self._stacks: dict[int, LayerStack | None] = {}
        # by id of the model: a step of decodes as one C call, or None where it cannot be
        self._decode_forwards: dict[int, DecodeForward | None] = {}
        self.widen_rows = {}  # (set by the engine: see `KernelOps.measures_widening`)

    def linear(self, x, layer):
        packed = getattr(layer, "packed", None)
        if isinstance(packed, BlockInt8Weight) and x.dtype == torch.bfloat16:
            rows = self.widen_rows.get((packed.n, packed.k))
            if rows is not None and x.shape[0] >= rows:
                return F.linear(x, widen_blocks(packed, x.dtype), layer.bias)
        return layer(x)

    def plan(self, step: StepPlan, spec: AttentionSpec) -> StepPlan:
        served, prefill_served = c_attention_served(spec)
        if not served:
            return super().plan(step, spec)
        step = replace(step, attention=spec, decodes=decode_rows(step))
        if prefill_served:
            return replace(step, prefills=prefill_rows(step))
        return plan_sdpa_prefills(step, spec)

    def write_kv(self, k, v, cache: LayerKVCache, plan: StepPlan) -> None:
        if not c_attention_served(plan.spec)[0]:
            super().write_kv(k, v, cache, plan)
            return
        kv_write.write_kv_native(
            k, v, cache.k, cache.v, plan.slot_mapping, cache.k_scale, cache.v_scale
        )

    def attend(self, q, k, v, cache: LayerKVCache, plan: StepPlan, scale: float) -> torch.Tensor:
        served, prefill_served = c_attention_served(plan.spec)
        if not served:
            return super().attend(q, k, v, cache, plan, scale)
        out = torch.empty_like(q)
        rows = plan.decodes
        if rows is not None:
            paged_decode.paged_decode_cpu(
                q,
                out,
                rows.tokens,
                cache.k,
                cache.v,
                rows.block_tables,
                rows.seq_lens,
                scale,
                plan.sliding_window,
                rows.max_seq_len,
                cache.k_scale,
                cache.v_scale,
            )
        chunks = plan.prefills
        if not prefill_served:
            sdpa_prefills(q, k, v, cache, plan, out, scale)
        elif chunks is not None:
            paged_prefill.paged_prefill_cpu(
                q,
                out,
                chunks.starts,
                chunks.q_lens,
                chunks.seq_lens,
                cache.k,
                cache.v,
                chunks.block_tables,
                scale,
                plan.sliding_window,
                cache.k_scale,
                cache.v_scale,
            )
        return out

    def _stack(self, layers, spec: AttentionSpec, rows: int) -> LayerStack | None:
        """The layers as one C call for a step of `rows` tokens, where every matmul weight is
        packed for a C kernel and both attention kernels serve the model."""
        if c_attention_served(spec) != (True, True):
            return None
        if self.widen_rows and rows >= min(self.widen_rows.values()):
            return None  # some projection widens at this many rows: layer by layer
        key = id(layers)
        if key not in self._stacks:
            self._stacks[key] = LayerStack.of(layers)
        return self._stacks[key]

    def run_layers(self, layers, x, rope, plan: StepPlan, caches):
        stack = self._stack(layers, plan.spec, x.shape[0])
        return None if stack is None else stack.run(x, plan, caches, rope)

    def forward_decodes(self, model, spec, token_ids, seq_lens, block_tables, caches, logits=False):
        if model.sharded:
            return None  # the ranks add their partial sums between layers
        stack = self._stack(model.layers, spec, len(token_ids))
        if stack is None:
            return None
        key = id(model)
        if key not in self._decode_forwards:
            self._decode_forwards[key] = DecodeForward.of(model, stack)
        forward = self._decode_forwards[key]
        if forward is None or (logits and forward.head is None):
            return None
        rope = self._table(model.rotary, max(seq_lens))
        window = model.config.sliding_window
        return forward.run(
            token_ids, seq_lens, block_tables, caches, spec.block_size, window, rope, logits
        )

    def add_rmsnorm(self, x, residual, weight, eps):
        return add_rmsnorm_native(x, residual, weight, eps)

    def rotary(self, q, k, tables: RopeTables):
        rotary_native_(q, k, *tables)
        return q, k

    def silu_and_mul(self, x):
        return silu_and_mul_native(x)
