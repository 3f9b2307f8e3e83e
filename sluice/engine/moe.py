"""A mixture of experts in place of a decoder layer's MLP (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE): a
router scores every expert for each token, the token runs through the `top_k` highest-scored gated
MLPs only, and their outputs are summed weighted by the softmax probabilities of the chosen
(divided by their sum where the model renormalizes them). Qwen2-MoE adds a shared expert every
token runs, scaled by the sigmoid of a gate of its own.

Each expert multiplies only the rows of the tokens routed to it, so a step reads the weights of the
experts its tokens chose and no others (a single decode reads `top_k` of them)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from .kernel_ops.base import KernelOps
from .weights import Linear, frozen_parameter


@dataclass
class ExpertWeights:
    # each matrix a float one, or already in the form the engine runs it (blocks a file stored)
    router: torch.Tensor  # [E, H]
    gate_up: list[torch.Tensor | nn.Module]  # each expert's [2*I, H] (gate rows, then up rows)
    down: list[torch.Tensor | nn.Module]  # each expert's [H, I]
    # Qwen2-MoE's shared expert and its gate [1, H]; None elsewhere
    shared_gate_up: torch.Tensor | nn.Module | None = None  # [2*Is, H]
    shared_down: torch.Tensor | nn.Module | None = None  # [H, Is]
    shared_gate: torch.Tensor | None = None  # [1, H]


def _matrix(m: torch.Tensor | nn.Module) -> nn.Module:
    return m if isinstance(m, nn.Module) else Linear(m)


class MixtureOfExperts(nn.Module):
    def __init__(self, w: ExpertWeights, top_k: int, renormalize: bool):
        super().__init__()
        self.router = frozen_parameter(w.router)
        self.gate_up = nn.ModuleList(_matrix(m) for m in w.gate_up)
        self.down = nn.ModuleList(_matrix(m) for m in w.down)
        self.top_k, self.renormalize = top_k, renormalize
        self.shared_gate = None
        if w.shared_gate_up is not None and w.shared_down is not None:
            assert w.shared_gate is not None
            self.shared_gate_up = _matrix(w.shared_gate_up)
            self.shared_down = _matrix(w.shared_down)
            self.shared_gate = frozen_parameter(w.shared_gate)

    @property
    def num_experts(self) -> int:
        return len(self.gate_up)

    def replace_matrices(self, transform: Callable[[str, Linear], nn.Module]) -> None:
        """Every expert's float matrix (the shared expert's too) in another form, one at a time,
        each given with its name as `tensor_names.layer_matrices` keys it ("experts.down.3";
        quantized: `weight_transforms.quantize_in_blocks`); the router stays as it is."""

        def replaced(name: str, m: nn.Module) -> nn.Module:
            return transform(name, m) if isinstance(m, Linear) else m

        for kind, matrices in (("gate_up", self.gate_up), ("down", self.down)):
            for e in range(len(matrices)):
                matrices[e] = replaced(f"experts.{kind}.{e}", matrices[e])
        if self.shared_gate is not None:
            self.shared_gate_up = replaced("experts.shared_gate_up", self.shared_gate_up)
            self.shared_down = replaced("experts.shared_down", self.shared_down)

    def route(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, top_k] in h's dtype, experts [T, top_k]) of each token: the softmax
        (in float32) of its router scores, the top_k highest."""
        probs = torch.softmax(torch.nn.functional.linear(h, self.router), dim=-1, dtype=torch.float)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(h.dtype), experts

    def forward(self, h: torch.Tensor, ops: KernelOps) -> torch.Tensor:
        """The normed input h [T, H] -> the MLP's output [T, H]."""
        weights, experts = self.route(h)
        out = torch.zeros_like(h)
        for e in torch.unique(experts).tolist():
            rows, slot = torch.where(experts == e)
            x = ops.silu_and_mul(ops.linear(h[rows], self.gate_up[e]))
            y = ops.linear(x, self.down[e]) * weights[rows, slot, None]
            out.index_add_(0, rows, y)
        if self.shared_gate is not None:
            x = ops.silu_and_mul(ops.linear(h, self.shared_gate_up))
            gate = torch.sigmoid(torch.nn.functional.linear(h, self.shared_gate))
            out += gate * ops.linear(x, self.shared_down)
        return out
