"""Deterministic mode on CUDA (`EngineConfig.deterministic` with a GPU; Triton's interpreter on the
CPU for the tests): the guarantees of `deterministic_ops` from Triton kernels.

- matmuls: `fixed_order_matmul` (each element one FMA chain over K in order, written out rather
  than left to `tl.dot`, never split), on the weights as loaded (cuBLAS chooses its algorithm and
  split of K by shape);
- attention: every new token of the step, prefill chunks' too, as a decode row of its own
  (`step_plan.token_rows`: its sequence's block table, its position + 1 as context) through the
  decode kernel unsplit, which walks a row's keys in fixed tiles in position order with an online
  softmax: a token attends with the same bits as a decode, in a first prefill, a later chunk or
  after a prefix-cache hit. It reads each token's context on its own, so a long prefill costs
  more than through SDPA's kernel; that is the price of the mode. Its dots never put two tokens
  in one tile and a head is always at the same row, so their order (the tensor cores', or numpy's
  BLAS in the interpreter) is the same for a token whatever the batch;
- rotary: the chunked table of `deterministic_ops`;
- RMSNorm, SiLU, the KV write and the draw: the Triton family's kernels, one program a row.

Refused at start: quantized weights (no fixed-order int8 kernel here yet) and, as on the CPU, a
quantized KV cache.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from ..errors import ConfigError
from ..paged_cache import LayerKVCache
from ..step_plan import AttentionSpec, StepPlan, token_rows
from ..weights import Linear
from .chunked_rope import ChunkedRope
from .triton_ops import TritonOps

ATTENTION_BLOCK_N = 16  # keys a tile: one for every call, whatever the context lengths


class DeterministicTritonOps(ChunkedRope, TritonOps):
    name = "deterministic-triton"
    weight_layout = "plain"
    quantizations = ()
    captures_decode_graphs = False  # (a graph is the default family's decode step)
    fixes_plain_layers_only = True

    def check(self, spec: AttentionSpec) -> None:
        if spec.quantized_cache:
            raise ConfigError(
                "deterministic mode does not run with a quantized KV cache",
                field="kv_cache_dtype",
            )

    def plan(self, step: StepPlan, spec: AttentionSpec) -> StepPlan:
        return replace(step, attention=spec, decodes=token_rows(step))

    def attend(self, q, k, v, cache: LayerKVCache, plan: StepPlan, scale: float) -> torch.Tensor:
        from ..kernels.paged_attention import paged_decode_attention_triton

        rows = plan.decodes
        if rows is None:
            return torch.empty_like(q)
        return paged_decode_attention_triton(
            q,
            cache.k,
            cache.v,
            rows.block_tables,
            rows.seq_lens,
            scale,
            sliding_window=plan.sliding_window,
            num_splits=1,
            max_seq_len=rows.max_seq_len,
            block_n=ATTENTION_BLOCK_N,
        )

    def linear(self, x, layer: nn.Module):
        from ..kernels.fixed_order_matmul import fixed_order_matmul_triton

        if type(layer) is not Linear:
            raise ConfigError(
                f"deterministic mode on CUDA multiplies plain weights, not {type(layer).__name__}",
                field="deterministic",
            )
        return fixed_order_matmul_triton(x, layer.weight, layer.bias)
