"""A decoder layer's small operations in C (`layer_ops.c`), float32 or bfloat16 on the CPU.

Same signatures and semantics as the torch references in `sluice.engine.kernels` (norm, rotary,
activation) and their Triton kernels, so the model's fused forward runs on either set."""

from __future__ import annotations

import torch

from . import require_library

DTYPES = (torch.float32, torch.bfloat16)
MAX_BF16_HEAD_DIM = 512  # 2 * STAGE in layer_ops.c


def _check_rows(name: str, t: torch.Tensor, width: int, dtype: torch.dtype) -> None:
    if (
        t.dim() != 2
        or t.dtype != dtype
        or t.device.type != "cpu"
        or t.stride(1) != 1
        or t.shape[1] < width
    ):
        raise ValueError(
            f"{name}: a {dtype} CPU matrix with contiguous rows of >= {width} expected, "
            f"got {tuple(t.shape)} {t.dtype} strides {t.stride()}"
        )


def _check_dtype(x: torch.Tensor) -> int:
    if x.dtype not in DTYPES:
        raise ValueError(f"float32 or bfloat16 expected, got {x.dtype}")
    return int(x.dtype == torch.bfloat16)


def add_rmsnorm_native(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight * rmsnorm(x + residual), x + residual); residual None: (weight * rmsnorm(x), x).
    All of x's type (float32 or bfloat16)."""
    bf16 = _check_dtype(x)
    rows, width = x.shape
    _check_rows("x", x, width, x.dtype)
    if residual is not None:
        _check_rows("residual", residual, width, x.dtype)
    if not weight.is_contiguous() or weight.dtype != x.dtype or weight.shape != (width,):
        raise ValueError(f"weight must be a contiguous {x.dtype} vector of {width}")
    out = torch.empty(rows, width, dtype=x.dtype)
    res_out = x if residual is None else torch.empty(rows, width, dtype=x.dtype)
    require_library().sluice_add_rmsnorm(
        x.data_ptr(),
        x.stride(0),
        None if residual is None else residual.data_ptr(),
        0 if residual is None else residual.stride(0),
        res_out.data_ptr(),
        res_out.stride(0),
        weight.data_ptr(),
        eps,
        out.data_ptr(),
        out.stride(0),
        rows,
        width,
        bf16,
        torch.get_num_threads(),
    )
    return out, res_out


def silu_and_mul_native(x: torch.Tensor) -> torch.Tensor:
    """x [T, 2I] (gate | up) -> silu(gate) * up [T, I], of x's type (float32 or bfloat16)."""
    bf16 = _check_dtype(x)
    rows, both = x.shape
    if both % 2:
        raise ValueError(f"x must be [T, 2*I], got {tuple(x.shape)}")
    _check_rows("x", x, both, x.dtype)
    out = torch.empty(rows, both // 2, dtype=x.dtype)
    require_library().sluice_silu_and_mul(
        x.data_ptr(),
        x.stride(0),
        out.data_ptr(),
        out.stride(0),
        rows,
        both // 2,
        bf16,
        torch.get_num_threads(),
    )
    return out


def rotary_native_(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """In place on q [T, Hq, D] and k [T, Hkv, D] (float32 or bfloat16, one type; heads contiguous
    within a token); cos, sin [T, D/2] float32."""
    bf16 = _check_dtype(q)
    rows, hq, d = q.shape
    hkv = k.shape[1]
    for name, t, heads in (("q", q, hq), ("k", k, hkv)):
        if (
            t.dtype != q.dtype
            or t.stride(2) != 1
            or t.stride(1) != d
            or t.shape[0] != rows
            or t.shape[2] != d
        ):
            raise ValueError(
                f"{name}: {q.dtype} [{rows}, {heads}, {d}] with contiguous heads expected, "
                f"got {tuple(t.shape)} {t.dtype} strides {t.stride()}"
            )
    if d % 2 or (bf16 and d > MAX_BF16_HEAD_DIM):
        raise ValueError(
            f"head_dim must be even (and at most {MAX_BF16_HEAD_DIM} in bfloat16), got {d}"
        )
    cos = cos.reshape(rows, -1).to(torch.float32).contiguous()
    sin = sin.reshape(rows, -1).to(torch.float32).contiguous()
    if cos.shape[1] != d // 2 or sin.shape[1] != d // 2:
        raise ValueError(
            f"cos and sin must be [{rows}, {d // 2}], got {tuple(cos.shape)} and {tuple(sin.shape)}"
        )
    require_library().sluice_rotary(
        q.data_ptr(),
        q.stride(0),
        hq,
        k.data_ptr(),
        k.stride(0),
        hkv,
        d,
        cos.data_ptr(),
        sin.data_ptr(),
        rows,
        bf16,
        torch.get_num_threads(),
    )
