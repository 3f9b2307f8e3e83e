"""Fused Triton kernels for the engine's hot path on CUDA, each beside a torch reference.

Every module holds one concept: `<op>_torch` (plain torch, the reference) and `<op>_triton` (the
kernel) with the same signature. The engine calls them through its Triton kernel family
(`sluice.engine.kernel_ops`), its default on CUDA.
On a machine without a GPU the kernels run in Triton's interpreter (`TRITON_INTERPRET=1`, which
must be set before these modules are imported): that is how the tests check them on the CPU.

Modules are imported lazily: importing the engine does not import Triton.
"""

from __future__ import annotations

import os


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (set before the first kernel import)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True
