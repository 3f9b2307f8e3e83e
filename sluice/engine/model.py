"""Llama / Mistral / Qwen2 / Gemma 3 decoder, run over a flat batch of tokens through a kernel
family.

Shapes: T tokens in the flat batch, H hidden size, Hq/Hkv query/KV heads of size D.
q/k/v are one [Hq*D + 2*Hkv*D, H] matrix and gate/up one [2*I, H] matrix, so a layer does four
matmuls. The residual stream is kept apart from each sub-layer's output and added by the next
norm (`KernelOps.add_rmsnorm`), which is where the fused kernels save a pass over the hidden
states. Norms follow HF's RMSNorm exactly (float32 statistics, cast back, then scale), so float32
logits match transformers to ~1e-6.

Gemma 3's layer (`GemmaDecoderLayer`) adds to this: norms that scale by 1 + weight in float32
(`KernelOps.add_rmsnorm_offset`), norms on the attention and MLP outputs, an RMSNorm over each head
of q and k before rotary, GeGLU, and local layers (a sliding window, their own rotary theta)
between global ones; embeddings scaled by sqrt(H). Each layer attends with its window's plan
(`StepPlan.for_window`) and rotates with its rotary's tables.

This is the layer-by-layer route of a step (`forward.LayerByLayer`); the engine may run the same
arithmetic by another (`forward`: the native family's one C call for the whole stack).

Under tensor parallelism (`tensor_parallel`) each rank's model holds some of the heads and MLP
columns; o_proj and down then give partial sums, which `all_reduce` adds up across the ranks, and
the layers run one by one (the C stack cannot stop between layers to communicate).

The weights come from `loader` (tensor names and shapes are the loader's business) and may be
transformed after building (packed for oneDNN, quantized: `weight_transforms.transform_weights`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
from torch import nn

from .config import ModelConfig
from .kernel_ops.base import KernelOps
from .kernel_ops.torch_ops import TorchOps
from .moe import ExpertWeights, MixtureOfExperts
from .paged_cache import LayerKVCache
from .rope import RotaryEmbedding
from .step_plan import AttentionSpec, StepPlan
from .weights import Embedding, Linear, frozen_parameter


@dataclass
class LayerWeights:
    input_norm: torch.Tensor  # [H]
    post_attention_norm: torch.Tensor  # [H]
    # each projection a float matrix, or already in the form the engine runs it (its bias in it)
    qkv: torch.Tensor | nn.Module  # [Hq*D + 2*Hkv*D, H]
    qkv_bias: torch.Tensor | None
    o: torch.Tensor | nn.Module  # [H, Hq*D]
    o_bias: torch.Tensor | None
    # the dense MLP's (None where the layer's MLP is a mixture of experts)
    gate_up: torch.Tensor | nn.Module | None  # [2*I, H]
    down: torch.Tensor | nn.Module | None  # [H, I]
    # Gemma (`ModelConfig.sandwich_norms`); None elsewhere. (Its post_attention_norm is the
    # attention output's norm, pre_feedforward_norm the MLP input's.)
    pre_feedforward_norm: torch.Tensor | None = None  # [H]
    post_feedforward_norm: torch.Tensor | None = None  # [H]
    # Gemma and Qwen3 (`ModelConfig.qk_norm`); None elsewhere
    q_norm: torch.Tensor | None = None  # [D] ([Hq*D] for OLMoE: `ModelConfig.qk_norm_whole`)
    k_norm: torch.Tensor | None = None  # [D] ([Hkv*D] for OLMoE)
    # a mixture-of-experts layer's MLP (`ModelConfig.is_moe_layer`); None elsewhere
    experts: ExpertWeights | None = None


@dataclass
class ModelWeights:
    # the vocabulary matrices as floats, or already in the form the engine runs them
    embed: torch.Tensor | nn.Module  # [V, H]
    norm: torch.Tensor  # [H], the final norm (in the model's dtype, on its device)
    lm_head: torch.Tensor | nn.Module | None  # [V, H]; None: tied to the (float) embedding
    layers: list[LayerWeights]


def _projection(weight: torch.Tensor | nn.Module, bias: torch.Tensor | None = None) -> nn.Module:
    return weight if isinstance(weight, nn.Module) else Linear(weight, bias)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, w: LayerWeights):
        super().__init__()
        c = config
        self.hq, self.hkv, self.d = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.q_size, self.kv_size = c.q_size, c.kv_size
        self.scale = c.attention_scale
        self.eps = c.rms_norm_eps
        self.input_norm = frozen_parameter(w.input_norm)
        self.post_attention_norm = frozen_parameter(w.post_attention_norm)
        # Linear as loaded; another form of `weights` after packing or quantizing
        self.qkv = _projection(w.qkv, w.qkv_bias)
        self.o_proj = _projection(w.o, w.o_bias)
        self.gate_up = None if w.gate_up is None else _projection(w.gate_up)
        self.down = None if w.down is None else _projection(w.down)
        self.experts = None
        if w.experts is not None:
            self.experts = MixtureOfExperts(w.experts, c.num_experts_per_tok, c.norm_topk_prob)
        # Qwen3's RMSNorm over each head of q and k before rotary, OLMoE's over all of them
        # (Gemma's: `GemmaDecoderLayer`)
        self.q_norm = None if w.q_norm is None else frozen_parameter(w.q_norm)
        self.k_norm = None if w.k_norm is None else frozen_parameter(w.k_norm)
        # Sums this rank's partial o_proj and down outputs over the tensor-parallel ranks; None
        # where the layer holds all heads and columns (`CausalLM.shard`)
        self.all_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None

    def project_qkv(
        self, h: torch.Tensor, ops: KernelOps
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The normed input [T, H] -> q [T, Hq, D], k and v [T, Hkv, D] (views of one matmul)."""
        t = h.shape[0]
        qkv = ops.linear(h, self.qkv)
        q = qkv[:, : self.q_size].view(t, self.hq, self.d)
        k = qkv[:, self.q_size : self.q_size + self.kv_size].view(t, self.hkv, self.d)
        v = qkv[:, self.q_size + self.kv_size :].view(t, self.hkv, self.d)
        return q, k, v

    def normed_heads(
        self, q: torch.Tensor, k: torch.Tensor, ops: KernelOps
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q [T, Hq, D] and k [T, Hkv, D], each head (OLMoE: each token's q and k whole) scaled to
        unit RMS and by its norm's weight (new contiguous tensors)."""
        assert self.q_norm is not None and self.k_norm is not None
        eps = self.eps
        # (OLMoE's weights span all heads: each token's q and k are one vector each)
        qd, kd = (self.q_norm.shape[0], self.k_norm.shape[0])
        q = ops.add_rmsnorm(q.reshape(-1, qd), None, self.q_norm, eps)[0].view(q.shape)
        k = ops.add_rmsnorm(k.reshape(-1, kd), None, self.k_norm, eps)[0].view(k.shape)
        return q, k

    def attention_output(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        rope,
        plan: StepPlan,
        cache: LayerKVCache,
        ops: KernelOps,
    ) -> torch.Tensor:
        """Rotated q and k, k and v into the cache, attention, o_proj (summed over the ranks)."""
        q, k = ops.rotary(q, k, rope)
        ops.write_kv(k, v, cache, plan)
        attn = ops.attend(q, k, v, cache, plan, self.scale)
        return self.reduced(ops.linear(attn.reshape(q.shape[0], self.q_size), self.o_proj))

    def reduced(self, x: torch.Tensor) -> torch.Tensor:
        """A sub-layer's output summed over the tensor-parallel ranks (as it is, unsharded)."""
        return x if self.all_reduce is None else self.all_reduce(x)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        rope,
        plan: StepPlan,
        cache: LayerKVCache,
        ops: KernelOps,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, residual) -> (x, residual): the layer's input is x + residual (residual None: x)."""
        h, residual = ops.add_rmsnorm(x, residual, self.input_norm, self.eps)
        q, k, v = self.project_qkv(h, ops)
        if self.q_norm is not None:
            q, k = self.normed_heads(q, k, ops)
        x = self.attention_output(q, k, v, rope, plan, cache, ops)

        h, residual = ops.add_rmsnorm(x, residual, self.post_attention_norm, self.eps)
        return self.reduced(self.mlp(h, ops)), residual

    def mlp(self, h: torch.Tensor, ops: KernelOps) -> torch.Tensor:
        """The normed input [T, H] -> the MLP's output (this rank's part of it)."""
        if self.experts is not None:
            return self.experts(h, ops)
        assert self.gate_up is not None and self.down is not None
        return ops.linear(ops.silu_and_mul(ops.linear(h, self.gate_up)), self.down)


class GemmaDecoderLayer(DecoderLayer):
    """Gemma 3's layer: every norm scales by 1 + weight in float32; the attention and MLP outputs
    are normed before their residual add; q and k are normed per head before rotary; GeGLU."""

    def __init__(self, config: ModelConfig, w: LayerWeights):
        super().__init__(config, w)
        assert w.pre_feedforward_norm is not None and w.post_feedforward_norm is not None
        assert self.q_norm is not None and self.k_norm is not None
        self.pre_feedforward_norm = frozen_parameter(w.pre_feedforward_norm)
        self.post_feedforward_norm = frozen_parameter(w.post_feedforward_norm)
        self.gelu = config.hidden_act == "gelu_pytorch_tanh"

    def normed_heads(
        self, q: torch.Tensor, k: torch.Tensor, ops: KernelOps
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """As Qwen3's, each head's norm scaling by 1 + weight in float32."""
        assert self.q_norm is not None and self.k_norm is not None
        q = ops.add_rmsnorm_offset(q, None, self.q_norm, self.eps)[0]
        k = ops.add_rmsnorm_offset(k, None, self.k_norm, self.eps)[0]
        return q, k

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        rope,
        plan: StepPlan,
        cache: LayerKVCache,
        ops: KernelOps,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        eps = self.eps
        h, residual = ops.add_rmsnorm_offset(x, residual, self.input_norm, eps)
        q, k, v = self.project_qkv(h, ops)
        q, k = self.normed_heads(q, k, ops)
        x = self.attention_output(q, k, v, rope, plan, cache, ops)
        x = ops.add_rmsnorm_offset(x, None, self.post_attention_norm, eps)[0]

        h, residual = ops.add_rmsnorm_offset(x, residual, self.pre_feedforward_norm, eps)
        assert self.gate_up is not None and self.down is not None  # (Gemma's MLP is dense)
        gate_up = ops.linear(h, self.gate_up)
        act = ops.gelu_tanh_and_mul(gate_up) if self.gelu else ops.silu_and_mul(gate_up)
        x = self.reduced(ops.linear(act, self.down))
        return ops.add_rmsnorm_offset(x, None, self.post_feedforward_norm, eps)[0], residual


class CausalLM(nn.Module):
    def __init__(self, config: ModelConfig, weights: ModelWeights, ops: KernelOps | None = None):
        super().__init__()
        self.config = config
        embed = weights.embed
        if not isinstance(embed, nn.Module):
            embed = Embedding(embed)
        self.embed_tokens: nn.Module = embed  # another form after `weight_transforms.quantize_int8`
        layer_type = GemmaDecoderLayer if config.sandwich_norms else DecoderLayer
        self.layers = nn.ModuleList(layer_type(config, w) for w in weights.layers)
        self.norm = frozen_parameter(weights.norm)
        self.eps = config.rms_norm_eps
        head = embed.weight if weights.lm_head is None else weights.lm_head
        # another form after packing or quantizing
        self.lm_head: nn.Module = head if isinstance(head, nn.Module) else Linear(head)
        device = weights.norm.device
        self.rotary = RotaryEmbedding(config, device=device)
        # the rotaries the layers use, and which one each layer takes (`uses_local_rotary`)
        self.rotaries = [self.rotary]
        if config.local_rope_theta is not None:
            local = replace(config, rope_theta=config.local_rope_theta, rope_scaling=None)
            self.rotaries.append(RotaryEmbedding(local, device=device))
        self.layer_rotary = [
            int(config.uses_local_rotary(n)) for n in range(config.num_hidden_layers)
        ]
        self.layer_windows = [config.layer_window(n) for n in range(config.num_hidden_layers)]
        self.dtype = weights.norm.dtype
        self.ops: KernelOps = ops or TorchOps()
        self.sharded = False

    def shard(self, all_reduce: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Run as one rank of a tensor-parallel group: this model holds its share of the heads
        and columns, and `all_reduce` sums the layers' partial outputs over the ranks."""
        for layer in self.layers:
            assert isinstance(layer, DecoderLayer)
            layer.all_reduce = all_reduce
        self.sharded = True

    @property
    def device(self) -> torch.device:
        return self.norm.device

    @torch.inference_mode()
    def forward(
        self, input_ids: torch.Tensor, plan: StepPlan, kv_caches: list[LayerKVCache]
    ) -> torch.Tensor:
        """input_ids [T] (at `plan.positions`) -> final-norm hidden states [T, H]."""
        return self.forward_embedded(self.embed_tokens(input_ids), plan, kv_caches)

    @torch.inference_mode()
    def forward_embedded(
        self, x: torch.Tensor, plan: StepPlan, kv_caches: list[LayerKVCache]
    ) -> torch.Tensor:
        """The tokens' embeddings x [T, H] -> final-norm hidden states [T, H]."""
        ops = self.ops
        ropes = [ops.rotary_tables(r, plan.positions, x.dtype) for r in self.rotaries]
        scale = self.config.embedding_scale
        if scale is not None:  # as HF: the scale rounded to float32, then to the model dtype
            x = x * torch.tensor(scale, dtype=torch.float32).to(x.dtype)
        residual = None
        for layer, cache, rotary, window in zip(
            self.layers, kv_caches, self.layer_rotary, self.layer_windows
        ):
            x, residual = layer(x, residual, ropes[rotary], plan.for_window(window), cache, ops)
        return self.final_norm(x, residual)

    def plan(self, layout: StepPlan, spec: AttentionSpec) -> StepPlan:
        """A step's layout planned by the kernel family, once for each window the layers attend
        with (`StepPlan.for_window`)."""
        planned = self.ops.plan(layout, spec)
        others = {
            w: self.ops.plan(replace(layout, sliding_window=w), spec)
            for w in dict.fromkeys(self.layer_windows)
            if w != layout.sliding_window
        }
        return replace(planned, other_windows=others) if others else planned

    def final_norm(self, x: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        """The last layer's (x, residual) -> final-norm hidden states [T, H]."""
        if self.config.norm_adds_one:
            return self.ops.add_rmsnorm_offset(x, residual, self.norm, self.eps)[0]
        return self.ops.add_rmsnorm(x, residual, self.norm, self.eps)[0]

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, H] -> logits [N, V] float32.

        The matmul runs in the model dtype (bf16 matmuls accumulate in float32 and round once at
        the end) and is then upcast, as vLLM and transformers do, rather than keeping a float32
        copy of the vocabulary matrix."""
        logits = self.ops.linear(hidden, self.lm_head).float()
        cap = self.config.final_logit_softcapping
        if cap is not None:  # (in float32; HF caps in the model dtype)
            logits = torch.tanh(logits / cap) * cap
        return logits
