"""The sampler's softmax arithmetic in deterministic mode (`cpu_kernels.row_softmax`) against a
float64 reference: log-sum-exp, exp(x - shift) and running sums, with masked (-inf) entries
weighing exactly 0, rows of every length around the 16-lane vectors, and a row of -inf."""

from __future__ import annotations

import os

import pytest
import torch

from sluice.engine import cpu_kernels
from sluice.engine.softmax_math import FixedOrderSoftmax

# (under CI a machine without the kernels fails here: these tests are what the promise rests on)
pytestmark = pytest.mark.skipif(
    cpu_kernels.library() is None and os.environ.get("CI", "").lower() not in ("1", "true", "yes"),
    reason="the native CPU kernels are unavailable here",
)
FIXED = FixedOrderSoftmax()


@pytest.mark.parametrize("width", [1, 15, 16, 17, 1000, 49152])
def test_softmax_pieces_match_float64(width):
    g = torch.Generator().manual_seed(width)
    x = torch.randn(4, width, generator=g) * 8
    keep = max(1, width // 3)
    x[1, keep:] = float("-inf")  # a truncated row keeps its first third
    ref = x.double()
    lse = FIXED.logsumexp(x)
    assert torch.allclose(
        lse.double(), ref.logsumexp(-1), rtol=0, atol=4e-6 * (1 + lse.abs().max())
    )
    probs = FIXED.softmax(x)
    assert torch.allclose(probs.double(), torch.softmax(ref, -1), rtol=2e-6, atol=1e-9)
    assert torch.all(probs[1, keep:] == 0)
    assert torch.allclose(
        FIXED.cumsum(probs).double(), probs.double().cumsum(-1), rtol=0, atol=1e-5
    )
    lp = FIXED.log_softmax(x)
    kept = torch.isfinite(lp)
    assert torch.equal(kept, torch.isfinite(x))
    assert torch.allclose(lp[kept].double(), torch.log_softmax(ref, -1)[kept], atol=2e-5)


def test_running_sums_are_left_to_right():
    x = torch.tensor([[1.0, 2.0**-24, 2.0**-24, -1.0]])
    # 1 + 2^-24 rounds back to 1 each time: left to right gives 0 at the end, not 2^-23
    assert FIXED.cumsum(x).tolist() == [[1.0, 1.0, 1.0, 0.0]]


def test_a_row_of_minus_infinity_has_a_log_sum_exp_of_minus_infinity():
    assert FIXED.logsumexp(torch.full((2, 5), float("-inf"))).tolist() == [float("-inf")] * 2


def test_rows_are_independent_of_their_neighbours():
    x = torch.randn(64, 333) * 5
    alone = torch.stack([FIXED.log_softmax(x[i : i + 1])[0] for i in range(64)])
    assert torch.equal(FIXED.log_softmax(x), alone)
