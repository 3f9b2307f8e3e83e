"""The torch family: plain torch everywhere, the reference the other families are measured by.

Its numerics are transformers' (each operation rounds to the model dtype where HF's would), which
the HF parity tests rely on. Attention is `attention.py`'s paged path; a quantized KV cache is
written by `kernels.kv_cache.write_kv_torch`, and the blocks a step reads are dequantized into a
compact temporary cache (block tables renumbered to match), so the same attention code runs on it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from .. import attention
from ..paged_cache import LayerKVCache
from ..rope import RotaryEmbedding, apply_rotary, full_width
from ..sampling_params import SamplingParams
from ..step_plan import AttentionSpec, StepPlan, compact_cache
from ..truncated_draw import draw_torch
from .base import KernelOps, RopeTables


class TorchOps(KernelOps):
    name = "torch"

    def plan(self, step: StepPlan, spec: AttentionSpec) -> StepPlan:
        hkv = spec.num_kv_heads
        if not spec.quantized_cache:
            return replace(
                step, attention=spec, torch_attention=attention.plan_torch_attention(step, hkv)
            )
        compact = compact_cache(step, None)
        planned = attention.plan_torch_attention(compact.plan, hkv, write_rows=False)
        return replace(
            step,
            attention=spec,
            compact=replace(compact, plan=replace(compact.plan, torch_attention=planned)),
        )

    def write_kv(self, k, v, cache: LayerKVCache, plan: StepPlan) -> None:
        if not cache.quantized:
            attention.write_kv(k, v, cache.k, cache.v, plan)
            return
        from ..kernels.kv_cache import write_kv_torch

        write_kv_torch(k, v, cache.k, cache.v, plan.slot_mapping, cache.k_scale, cache.v_scale)

    def attend(self, q, k, v, cache: LayerKVCache, plan: StepPlan, scale: float) -> torch.Tensor:
        if not cache.quantized:
            return attention.paged_attention(q, cache.k, cache.v, plan, scale, k, v)
        compact = _compact(plan)
        kc, vc = dequantize_blocks(cache, compact.ids, q.dtype)
        return attention.paged_attention(q, kc, vc, compact.plan, scale, k, v)

    def add_rmsnorm(self, x, residual, weight, eps):
        r = x if residual is None else x + residual
        r32 = r.to(torch.float32)
        return weight * (r32 * torch.rsqrt(r32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype), r

    def rotary_tables(self, rotary: RotaryEmbedding, positions, dtype) -> RopeTables:
        return full_width(*rotary.cos_sin(positions, dtype))

    def rotary(self, q, k, tables: RopeTables):
        cos, sin = tables
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)

    def silu_and_mul(self, x):
        gate, up = x.split(x.shape[-1] // 2, dim=-1)
        return F.silu(gate).mul_(up)

    def linear(self, x, layer: nn.Module):
        return layer(x)

    def draw(self, logits, params: Sequence[SamplingParams], words: Sequence[int]):
        return draw_torch(logits, params, words, self.softmax_math)


def _compact(plan: StepPlan):
    if plan.compact is None:
        raise ValueError("the step was planned without the compacted blocks of a quantized cache")
    return plan.compact


def dequantize_blocks(
    cache: LayerKVCache, ids: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Blocks `ids` of a quantized cache as a compact K, V cache of `dtype`."""
    from ..kernels.kv_cache import dequantize_torch

    return (
        dequantize_torch(cache.k, cache.k_scale, ids, dtype),
        dequantize_torch(cache.v, cache.v_scale, ids, dtype),
    )


def plan_sdpa_prefills(step: StepPlan, spec: AttentionSpec) -> StepPlan:
    """`step` with what `sdpa_prefills` needs, for a family whose own kernels serve the decodes
    (and the KV write) but not the prefill chunks."""
    chunks = np.flatnonzero(step.query_lens_host > 1)
    if not len(chunks):
        return step
    hkv = spec.num_kv_heads
    if not spec.quantized_cache:
        planned = attention.plan_torch_attention(step, hkv, decodes=False, write_rows=False)
        return replace(step, torch_attention=planned)
    compact = compact_cache(step, chunks)
    planned = attention.plan_torch_attention(compact.plan, hkv, decodes=False, write_rows=False)
    return replace(
        step, compact=replace(compact, plan=replace(compact.plan, torch_attention=planned))
    )


def sdpa_prefills(
    q, k, v, cache: LayerKVCache, plan: StepPlan, out: torch.Tensor, scale: float
) -> None:
    """The step's prefill chunks through SDPA into `out`, on a dequantized copy of their blocks
    when the cache is quantized (planned by `plan_sdpa_prefills`)."""
    if cache.quantized:
        if plan.compact is None:
            return  # no prefill chunks this step
        kc, vc = dequantize_blocks(cache, plan.compact.ids, q.dtype)
        plan = plan.compact.plan
    else:
        kc, vc = cache.k, cache.v
    planned = plan.torch_attention
    if isinstance(planned, attention.TorchAttentionPlan):
        attention.prefill_attention(q, kc, vc, planned.prefills, out, scale, k, v)
