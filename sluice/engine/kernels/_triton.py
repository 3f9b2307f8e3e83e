"""Triton for the kernel modules, or a stand-in where it is not installed.

The CPU-only torch wheel comes without Triton, yet the kernel modules also hold the torch
references that the CPU paths use (int8 quantization, the quantized KV cache's encoding): so they
import Triton from here. Without it, kernels are still defined (as stand-ins, so the modules
import) and only launching one fails, with the reason; the Triton kernel family is never chosen
then (`kernels.triton_available`).
"""

from __future__ import annotations

from typing import Any

MISSING = (
    "Triton is not installed (the CPU-only torch wheel has none): pip install triton, or run "
    "with --kernels native or torch"
)

try:
    import triton
    import triton.language as tl
except ImportError:

    class _Absent:
        """Stands for `triton`, `tl` and whatever is built from them at import time."""

        def __getattr__(self, name: str) -> Any:
            return self

        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            return self  # @triton.jit, @triton.autotune(...), triton.Config(...)

        def __getitem__(self, grid: Any) -> Any:
            raise ImportError(MISSING)  # kernel[grid](...): a launch

    triton = tl = _Absent()

__all__ = ["MISSING", "tl", "triton"]
