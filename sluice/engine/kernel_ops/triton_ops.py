"""The triton family (the CUDA default): the Triton kernels of `kernels` for the KV write (which
quantizes an int8 or fp8 cache as it writes), decode attention (reading a quantized cache
directly), RMSNorm with the residual add, rotary, SiLU-and-multiply, the int8 matmul and the
sampler's draw; prefill chunks still go through SDPA (on a dequantized copy of their blocks when
the cache is quantized). On a machine without a GPU they run in Triton's interpreter.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch
from torch import nn

from ..draws import signed
from ..paged_cache import LayerKVCache
from ..sampling_params import SamplingParams
from ..step_plan import AttentionSpec, StepPlan, decode_rows
from ..weights import Int8Linear
from .base import RopeTables
from .torch_ops import TorchOps, plan_sdpa_prefills, sdpa_prefills


class TritonOps(TorchOps):
    name = "triton"
    captures_decode_graphs = True

    def plan(self, step: StepPlan, spec: AttentionSpec) -> StepPlan:
        return plan_sdpa_prefills(replace(step, attention=spec, decodes=decode_rows(step)), spec)

    def write_kv(self, k, v, cache: LayerKVCache, plan: StepPlan) -> None:
        from ..kernels.kv_cache import write_kv_triton

        write_kv_triton(k, v, cache.k, cache.v, plan.slot_mapping, cache.k_scale, cache.v_scale)

    def attend(self, q, k, v, cache: LayerKVCache, plan: StepPlan, scale: float) -> torch.Tensor:
        from ..kernels.paged_attention import paged_decode_attention_triton

        out = torch.empty_like(q)
        rows = plan.decodes
        if rows is not None:
            o = paged_decode_attention_triton(
                q.index_select(0, rows.tokens),
                cache.k,
                cache.v,
                rows.block_tables,
                rows.seq_lens,
                scale,
                cache.k_scale,
                cache.v_scale,
                plan.sliding_window,
                max_seq_len=rows.max_seq_len,
            )
            out.index_copy_(0, rows.tokens, o)
        sdpa_prefills(q, k, v, cache, plan, out, scale)
        return out

    def add_rmsnorm(self, x, residual, weight, eps):
        from ..kernels.norm import add_rmsnorm_triton

        return add_rmsnorm_triton(x, residual, weight, eps)

    def rotary_tables(self, rotary, positions, dtype) -> RopeTables:
        cos, sin = rotary.cos_sin(positions, torch.float32)
        return cos.squeeze(1), sin.squeeze(1)

    def rotary(self, q, k, tables: RopeTables):
        from ..kernels.rotary import rotary_triton_

        rotary_triton_(q, k, *tables)
        return q, k

    def silu_and_mul(self, x):
        from ..kernels.activation import silu_and_mul_triton

        return silu_and_mul_triton(x)

    def linear(self, x, layer: nn.Module):
        if isinstance(layer, Int8Linear):
            from ..kernels.int8_linear import int8_linear_triton

            return int8_linear_triton(x, layer.qweight, layer.scale, layer.bias)
        return layer(x)

    def draw(self, logits, params: Sequence[SamplingParams], words: Sequence[int]):
        """Through the Triton sampling kernel: the row's random word keys its random stream."""
        from ..kernels.sampling import sample_triton

        device = logits.device
        n = len(params)
        seeds = torch.tensor([signed(w) for w in words], dtype=torch.int64, device=device)

        def column(values, dtype):
            return torch.tensor(values, dtype=dtype, device=device).reshape(n)

        vocab = logits.shape[1]
        return sample_triton(
            logits.contiguous(),
            column([1.0] * n, torch.float32),  # already divided by the temperature
            column([p.top_k if 0 < p.top_k < vocab else 0 for p in params], torch.int32),
            column([p.top_p for p in params], torch.float32),
            column([p.min_p for p in params], torch.float32),
            seeds,
        )
