"""What a kernel family provides: the operations a decoder layer, the LM head and the sampler need.

A layer calls these and nothing else, so the model reads like the math whichever kernels run it:

    h, residual = ops.add_rmsnorm(x, residual, norm_weight, eps)
    q, k = ops.rotary(q, k, rope)
    ops.write_kv(k, v, cache, plan)
    out = ops.attend(q, k, v, cache, plan, scale)
    y = ops.linear(ops.silu_and_mul(ops.linear(h, gate_up)), down)

Each step the model runner asks the family to `plan` the step: it adds to the `StepPlan` what its
attention kernels precompute, once for all layers.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import TYPE_CHECKING, ClassVar

import torch
from torch import nn

from ..softmax_math import TORCH_SOFTMAX, SoftmaxMath

if TYPE_CHECKING:
    from ..paged_cache import LayerKVCache
    from ..rope import RotaryEmbedding
    from ..sampling_params import SamplingParams
    from ..step_plan import AttentionSpec, StepPlan

RopeTables = tuple[
    torch.Tensor, torch.Tensor
]  # cos, sin of the step's positions, as rotary() takes them


class KernelOps(ABC):
    name: ClassVar[str]  # as `EngineConfig.kernels` names the family
    # The layout `weight_transforms.transform_weights` packs unquantized weights in for this family
    weight_layout: ClassVar[str] = "onednn"
    # How `--quantization int8` stores weights for this family (`weight_transforms.INT8_FORMATS`)
    int8_format: ClassVar[str] = "per-channel"
    # The `--quantization` settings the family multiplies (others are refused at start)
    quantizations: ClassVar[tuple[str, ...]] = ("int8", "int4")
    # Whether its decode steps can be captured as CUDA graphs and replayed (`captured_decode`)
    captures_decode_graphs: ClassVar[bool] = False
    # Whether it runs this library's C kernels (their build's CPU features then name the machine)
    runs_native_code: ClassVar[bool] = False
    # Whether the engine measures at start from how many rows a quantized projection is better
    # widened to bfloat16 for a oneDNN matmul (`widen_probe`), and hands the answer to
    # `widen_rows`: (N, K) of a weight -> rows; empty, always as stored
    measures_widening: ClassVar[bool] = False
    widen_rows: Mapping[tuple[int, int], int] = MappingProxyType({})
    # Whether, where its layers run as one native call, a step of decodes only may go from token
    # ids to logits in one call too (`cpu_kernels.decode_forward`)
    decodes_in_one_call: ClassVar[bool] = False
    # Whether the bits it promises (a deterministic family's) hold for the plain Llama layer
    # alone: what other layers add (Gemma's norms, GELU) runs through torch, whose vector and
    # scalar code may round an element differently by its place in the tensor
    fixes_plain_layers_only: ClassVar[bool] = False
    # The softmax arithmetic of the sampler's logprobs and of `draw` where the family uses
    # `truncated_draw` (torch's; a deterministic family's own order where it promises bits)
    softmax_math: ClassVar[SoftmaxMath] = TORCH_SOFTMAX

    def check(self, spec: AttentionSpec) -> None:
        """Raise ConfigError if this family cannot run a model of `spec` at all (most fall back
        to a slower path instead)."""
        return None

    @abstractmethod
    def plan(self, step: StepPlan, spec: AttentionSpec) -> StepPlan:
        """The step with what this family's attention needs precomputed (`step` is not changed)."""

    @abstractmethod
    def write_kv(
        self, k: torch.Tensor, v: torch.Tensor, cache: LayerKVCache, plan: StepPlan
    ) -> None:
        """k, v [T, Hkv, D] of the step's new tokens into their cache slots."""

    @abstractmethod
    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cache: LayerKVCache,
        plan: StepPlan,
        scale: float,
    ) -> torch.Tensor:
        """q [T, Hq, D] -> [T, Hq, D]: decodes and prefill chunks over their cached context (this
        step's k, v [T, Hkv, D] already written)."""

    @abstractmethod
    def add_rmsnorm(
        self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(weight * rmsnorm(x + residual), x + residual); residual None: (weight * rmsnorm(x),
        x)."""

    def add_rmsnorm_offset(
        self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """As `add_rmsnorm`, scaled by 1 + weight, the scaling in float32 before the cast back
        (Gemma's RMSNorm, as transformers computes it); over the last dimension of x."""
        r = x if residual is None else x + residual
        r32 = r.to(torch.float32)
        normed = r32 * torch.rsqrt(r32.pow(2).mean(-1, keepdim=True) + eps)
        return (normed * (1.0 + weight.to(torch.float32))).to(x.dtype), r

    @abstractmethod
    def rotary_tables(
        self, rotary: RotaryEmbedding, positions: torch.Tensor, dtype: torch.dtype
    ) -> RopeTables:
        """cos and sin of the step's positions in the form `rotary` takes (built once a step)."""

    @abstractmethod
    def rotary(
        self, q: torch.Tensor, k: torch.Tensor, tables: RopeTables
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q [T, Hq, D] and k [T, Hkv, D] rotated (in place where the family can)."""

    @abstractmethod
    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, 2I] (gate | up) -> silu(gate) * up [T, I]."""

    def gelu_tanh_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, 2I] (gate | up) -> gelu(gate) * up [T, I], GELU by its tanh approximation
        (GeGLU)."""
        gate, up = x.split(x.shape[-1] // 2, dim=-1)
        return torch.nn.functional.gelu(gate, approximate="tanh").mul_(up)

    @abstractmethod
    def linear(self, x: torch.Tensor, layer: nn.Module) -> torch.Tensor:
        """x @ W.T (+ bias) for a weight in any of the forms of `weights` (plain, packed, int8)."""

    def runs_layer_stack(self, spec: AttentionSpec) -> bool:
        """Whether a step's decoder layers may run as one native call for a model of `spec`
        (`forward.NativeStack`, where every matmul weight is packed for the C kernels), with the
        bits this family's operations give layer by layer."""
        return False

    @abstractmethod
    def draw(
        self, logits: torch.Tensor, params: Sequence[SamplingParams], words: Sequence[int]
    ) -> torch.Tensor:
        """One token per row from the min-p / top-k / top-p truncated softmax of `logits` (already
        penalized and divided by the temperature); the row's random word (`draws.draw_word`)
        alone decides its draw."""

    def __str__(self) -> str:
        return self.name
