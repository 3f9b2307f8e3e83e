"""The native family (the CPU default where a C compiler built them): the C kernels of
`cpu_kernels` for the KV write, decode and prefill attention on the cache in place (float32 or
bfloat16 models, on a cache of the model's type or an int8 one, read directly), RMSNorm with the
residual add, rotary (cos and sin from a table: `ChunkedRope`) and SiLU-and-multiply, int8
weights multiplied as stored (`block_int8_linear`); torch (oneDNN) for the float matmuls, and the
sampler. Where every matmul weight is packed for a C kernel (int8 or int4 weights), the engine
runs a step's whole stack of layers as one C call with these same kernels (`runs_layer_stack`,
`forward.NativeStack`), and a step of decodes only from token ids to the logits
(`decodes_in_one_call`). A step with enough rows may widen a quantized weight to bfloat16 for a
oneDNN matmul instead, where the engine measured that faster (`widen_rows`, `widen_probe`).

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

    decodes_in_one_call = True

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

    def runs_layer_stack(self, spec: AttentionSpec) -> bool:
        return c_attention_served(spec) == (True, True)

    def add_rmsnorm(self, x, residual, weight, eps):
        return add_rmsnorm_native(x, residual, weight, eps)

    def rotary(self, q, k, tables: RopeTables):
        rotary_native_(q, k, *tables)
        return q, k

    def silu_and_mul(self, x):
        return silu_and_mul_native(x)
