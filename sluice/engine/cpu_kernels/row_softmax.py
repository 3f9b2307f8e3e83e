"""The softmax arithmetic of deterministic mode's sampler in an order fixed by `row_softmax.c`,
the same bits on every CPU (torch's log_softmax and softmax sum in the lanes of the CPU's widest
vectors)."""

from __future__ import annotations

import torch

from . import require_library


def _rows(name: str, x: torch.Tensor) -> torch.Tensor:
    if x.dim() != 2 or x.dtype != torch.float32 or x.device.type != "cpu":
        raise ValueError(f"{name}: a float32 CPU matrix expected, got {x.dtype} {tuple(x.shape)}")
    return x if x.stride(1) == 1 else x.contiguous()


def logsumexp_rows(x: torch.Tensor) -> torch.Tensor:
    """log(sum(exp(x))) of each row of x [N, V] -> [N]; -inf for a row of -inf."""
    x = _rows("x", x)
    out = torch.empty(x.shape[0], dtype=torch.float32)
    require_library().sluice_row_logsumexp(
        x.data_ptr(), x.stride(0), x.shape[0], x.shape[1], out.data_ptr(), torch.get_num_threads()
    )
    return out


def exp_shifted_rows(x: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    """exp(x - shift[row]) [N, V], for shifts at least each row's maximum (its log-sum-exp gives
    the softmax); -inf in x gives exactly 0."""
    x = _rows("x", x)
    if shift.shape != (x.shape[0],) or shift.dtype != torch.float32:
        raise ValueError(f"shift: float32 [{x.shape[0]}] expected, got {shift.dtype} {shift.shape}")
    shift = shift.contiguous()
    out = torch.empty(x.shape, dtype=torch.float32)
    require_library().sluice_row_exp_shifted(
        x.data_ptr(),
        x.stride(0),
        shift.data_ptr(),
        x.shape[0],
        x.shape[1],
        out.data_ptr(),
        torch.get_num_threads(),
    )
    return out


def cumsum_rows(x: torch.Tensor) -> torch.Tensor:
    """Running sums of each row of x [N, V], added left to right."""
    x = _rows("x", x)
    out = torch.empty(x.shape, dtype=torch.float32)
    require_library().sluice_row_cumsum(
        x.data_ptr(), x.stride(0), x.shape[0], x.shape[1], out.data_ptr()
    )
    return out
