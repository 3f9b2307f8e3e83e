"""The mixture of experts (`moe.MixtureOfExperts`) against a float64 reference written token by
token: the router's softmax, the top k (renormalized or not), the shared expert's sigmoid gate;
with int8 and 4-bit expert blocks on the native kernels, against the same reference multiplying
by each block matrix through its kernel; and a token runs only the experts it chose. Its place in
whole models is checked against transformers in test_model_vs_hf.py and test_architectures.py."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from sluice.engine.kernel_ops import resolve_kernel_ops
from sluice.engine.kernel_ops.torch_ops import TorchOps
from sluice.engine.moe import ExpertWeights, MixtureOfExperts
from sluice.engine.weights import BlockInt8Linear, Linear

H, WIDTH, SHARED, EXPERTS, TOP_K = 64, 32, 48, 8, 2  # (WIDTH: each expert's)


def weights(shared: bool, seed: int = 0) -> ExpertWeights:
    g = torch.Generator().manual_seed(seed)

    def matrix(rows: int, cols: int) -> torch.Tensor:
        return torch.randn(rows, cols, generator=g) * cols**-0.5

    return ExpertWeights(
        router=matrix(EXPERTS, H) * 4,  # (scores far apart: no near ties in the top k)
        gate_up=[matrix(2 * WIDTH, H) for _ in range(EXPERTS)],
        down=[matrix(H, WIDTH) for _ in range(EXPERTS)],
        shared_gate_up=matrix(2 * SHARED, H) if shared else None,
        shared_down=matrix(H, SHARED) if shared else None,
        shared_gate=matrix(1, H) if shared else None,
    )


def apply(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A matrix times one float64 vector: a float one's values in float64; a block one through
    its own kernel (which quantizes the activations as llama.cpp's does: checked against its
    contract in kernels/test_block_int8_linear.py)."""
    if isinstance(m, BlockInt8Linear):
        return m(x.float()[None])[0].double()
    assert isinstance(m, Linear)
    return m.weight.double() @ x


def reference(moe: MixtureOfExperts, h: torch.Tensor) -> torch.Tensor:
    """Token by token in float64 from the module's own matrices."""

    def gated_mlp(x, gate_up, down):
        gate, up = apply(gate_up, x).chunk(2)
        return apply(down, torch.nn.functional.silu(gate) * up)

    out = []
    for x in h.double():
        probs = torch.softmax(moe.router.double() @ x, dim=-1)
        top, chosen = torch.topk(probs, moe.top_k)
        if moe.renormalize:
            top = top / top.sum()
        y = sum(w * gated_mlp(x, moe.gate_up[e], moe.down[e]) for w, e in zip(top, chosen.tolist()))
        if moe.shared_gate is not None:
            gate = torch.sigmoid(moe.shared_gate.double() @ x)
            y = y + gate * gated_mlp(x, moe.shared_gate_up, moe.shared_down)
        out.append(y)
    return torch.stack(out)


def hidden(rows: int) -> torch.Tensor:
    return torch.randn(rows, H, generator=torch.Generator().manual_seed(9))


@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("shared", [False, True])
def test_the_float_mixture_is_the_float64_one(renormalize, shared):
    moe = MixtureOfExperts(weights(shared), TOP_K, renormalize)
    h = hidden(13)
    got = moe(h, TorchOps()).double()
    want = reference(moe, h)
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()


@pytest.mark.parametrize("bits", [8, 4])
def test_quantized_experts_multiply_the_values_their_blocks_stand_for(bits):
    try:
        ops = resolve_kernel_ops("native", "cpu")
    except Exception as e:  # no C compiler here
        pytest.skip(f"the native kernels are not built here: {e}")
    moe = MixtureOfExperts(weights(shared=True), TOP_K, renormalize=False)
    moe.replace_matrices(lambda _, m: BlockInt8Linear.from_weight(m.weight.data, None, bits))
    assert all(isinstance(m, BlockInt8Linear) for m in [*moe.gate_up, *moe.down])
    assert isinstance(moe.shared_gate_up, BlockInt8Linear)
    h = hidden(13)
    got = moe(h, ops).double()
    want = reference(moe, h)
    # (an activation rounded to another int8 code where float32 and float64 differ: a wrongly
    # routed or weighted expert would be off by the whole of its output)
    assert (got - want).abs().max() <= 1e-4 * want.abs().max()


class Counting(nn.Module):
    """A matrix that counts the rows it multiplies."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner, self.rows = inner, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.rows += x.shape[0]
        return self.inner(x)


def test_each_token_runs_only_the_experts_it_chose():
    moe = MixtureOfExperts(weights(shared=False), TOP_K, renormalize=True)
    moe.replace_matrices(lambda _, m: Counting(m))
    h = hidden(5)
    _, chosen = moe.route(h)
    moe(h, TorchOps())
    for e in range(EXPERTS):
        routed = int((chosen == e).sum())
        assert moe.gate_up[e].rows == routed and moe.down[e].rows == routed, e
    # a single decode: its top k experts' matrices, none of the others'
    for m in [*moe.gate_up, *moe.down]:
        m.rows = 0
    moe(h[:1], TorchOps())
    assert sum(m.rows > 0 for m in moe.gate_up) == TOP_K
