"""The deterministic family (`EngineConfig.deterministic`): every reduction of a step in an order
fixed by the request alone, so a sequence's logits are the same bits whatever else the step holds,
however its prompt was split into chunks, whether its prefix came from the cache, and however many
threads ran it.

- matmuls: `fixed_order_linear` (each output element one running sum over K in order; threads
  split rows and columns, never K), on weights packed for it at load (oneDNN's kernels choose
  their blocking by shape, and change a row's bits with the rows beside it); int8 weights through
  `block_int8_linear`, whose sums are in a fixed order already (activations quantized per row,
  each block's dot product exact, blocks added in order);
- attention: every sequence, decodes too, through the prefill kernel, whose query rows are
  independent lanes going over the keys in 16-key blocks in position order with an online
  softmax; keys past a row's position are masked to exact no-ops, so a token attends the same
  whether it is a decode, in a first prefill, a later chunk or after a prefix-cache hit (the
  decode kernel's two-pass softmax would give other bits);
- rotary: cos and sin from a table filled in fixed chunks of positions (`ChunkedRope`, as the
  native family does: torch computes a tensor's last elements with scalar code and the rest with
  vector code, so the same position could otherwise round differently in a step of another size);
- RMSNorm, SiLU, the KV write: the native kernels, one row at a time already;
- the sampler: its softmax arithmetic (logprobs' log-softmax, top-p's masses, the inverse CDF)
  through `row_softmax` (`FixedOrderSoftmax`: sums in 16 lanes, its own exp and log), torch's
  top-k (a selection: no arithmetic), one random word per row.

One arithmetic at every instruction-set level the kernels are built for: no multiply and add is
fused unless every path fuses it (`cpu_kernels.FLAGS`), every sum in the C kernels takes 16 lanes
whatever the vector width, and torch computes nothing here whose bits depend on the CPU (its
softmax would). One exception: bfloat16 on a CPU with the bfloat16 dot instruction (AVX512-BF16)
pairs k in the matmuls (`fixed_order_linear`), so bfloat16 there has bits of its own.
"""

from __future__ import annotations

from dataclasses import replace

from torch import nn

from ..errors import ConfigError
from ..softmax_math import FixedOrderSoftmax
from ..step_plan import AttentionSpec, StepPlan, prefill_rows
from ..weights import BlockInt8Linear, FixedOrderLinear
from .native_ops import NativeOps, c_attention_served


class DeterministicOps(NativeOps):
    name = "deterministic"
    weight_layout = "fixed-order"
    measures_widening = False  # (its int8 steps are never widened: the same bits at every size)
    decodes_in_one_call = False  # decodes go through the prefill kernel (`plan`)
    fixes_plain_layers_only = True
    softmax_math = FixedOrderSoftmax()

    def check(self, spec: AttentionSpec) -> None:
        served, prefill_served = c_attention_served(spec)
        if not (served and prefill_served):
            raise ConfigError(
                "deterministic mode needs the native attention kernels, which serve block size "
                f"16, head size 64 or 128 and up to 16 query heads per KV head; this model has "
                f"head size {spec.head_dim}, {spec.num_heads // spec.num_kv_heads} query heads per "
                f"KV head, block size {spec.block_size}",
                field="deterministic",
            )

    def plan(self, step: StepPlan, spec: AttentionSpec) -> StepPlan:
        # decodes as chunks of one, no decode rows: the native family's write_kv and attend then
        # run every sequence through the prefill kernel (`check` made sure it serves the model)
        return replace(step, attention=spec, prefills=prefill_rows(step, min_query_len=1))

    def linear(self, x, layer: nn.Module):
        if not isinstance(layer, (FixedOrderLinear, BlockInt8Linear)):
            raise ConfigError(
                f"deterministic mode multiplies weights packed for it, not {type(layer).__name__}",
                field="deterministic",
            )
        return layer(x)
