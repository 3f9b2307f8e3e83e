"""The softmax arithmetic the sampler's logprobs and draw use, in two forms: torch's (fast, its
sums in the lanes of the CPU's widest vectors, so its bits depend on the CPU and on torch's build)
and the native kernels' fixed order (`cpu_kernels.row_softmax`: the same bits on every CPU), which
deterministic mode uses."""

from __future__ import annotations

import torch

from .cpu_kernels.row_softmax import cumsum_rows, exp_shifted_rows, logsumexp_rows


class SoftmaxMath:
    """torch's: over the last dimension of [N, V] float32 rows."""

    def logsumexp(self, x: torch.Tensor) -> torch.Tensor:
        return x.logsumexp(dim=-1)

    def exp_shifted(self, x: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
        """exp(x - shift[row]), shift at least the row's maximum."""
        return (x - shift.unsqueeze(1)).exp()

    def cumsum(self, x: torch.Tensor) -> torch.Tensor:
        return x.cumsum(dim=-1)

    def softmax(self, x: torch.Tensor) -> torch.Tensor:
        return torch.softmax(x, dim=-1)

    def log_softmax(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log_softmax(x, dim=-1)


class FixedOrderSoftmax(SoftmaxMath):
    """The native kernels' (CPU tensors only)."""

    def logsumexp(self, x):
        return logsumexp_rows(x)

    def exp_shifted(self, x, shift):
        return exp_shifted_rows(x, shift)

    def cumsum(self, x):
        return cumsum_rows(x)

    def softmax(self, x):
        return self.exp_shifted(x, self.logsumexp(x))

    def log_softmax(self, x):
        return x - self.logsumexp(x).unsqueeze(1)


TORCH_SOFTMAX = SoftmaxMath()
