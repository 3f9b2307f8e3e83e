"""Fused Triton kernels for the engine's hot path on CUDA, each beside a torch reference.

Every module holds one concept: `<op>_torch` (plain torch, the reference and the CPU fallback)
and `<op>_triton` (the kernel) with the same signature. The engine picks the Triton ones on CUDA;
on the CPU it runs the torch path with attention and the small per-layer ops in C
(`sluice.engine.cpu_kernels`, backend "native") where a C compiler built them, else plain torch. `EngineConfig.kernels`
("auto", "torch", "triton", "native") forces one.
On a machine without a GPU the kernels run in Triton's interpreter (`TRITON_INTERPRET=1`, which
must be set before these modules are imported): that is how the tests check them on the CPU.

Modules are imported lazily: importing the engine does not import Triton.
"""
from __future__ import annotations

import os

KERNEL_BACKENDS = ("auto", "torch", "triton", "native")


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (set before the first kernel import)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def resolve_backend(choice: str, device_type: str) -> str:
    """"torch", "triton" or "native" for a configured choice on a device type ("cpu", "cuda")."""
    from sluice.engine.errors import EngineError

    if choice not in KERNEL_BACKENDS:
        raise EngineError(f"unknown kernels {choice!r}; choose one of {list(KERNEL_BACKENDS)}", field="kernels")
    if choice == "auto":
        if device_type == "cuda":
            return "triton" if triton_available() else "torch"
        return "native" if device_type == "cpu" and native_available() else "torch"
    if choice == "native":
        if device_type != "cpu":
            raise EngineError(f"kernels='native' are C kernels for the CPU, not for {device_type}", field="kernels")
        if not native_available():
            from sluice.engine.cpu_kernels import unavailable_reason

            raise EngineError(f"kernels='native' unavailable: {unavailable_reason()}", field="kernels")
    if choice == "triton":
        if not triton_available():
            raise EngineError("kernels='triton' but the triton package is not installed", field="kernels")
        if device_type != "cuda" and not interpreting():
            raise EngineError(
                "kernels='triton' on the CPU needs Triton's interpreter: set TRITON_INTERPRET=1 "
                "before starting (it is slow; meant for checking the kernels, not for serving)",
                field="kernels",
            )
    return choice


def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def native_available() -> bool:
    from sluice.engine.cpu_kernels import library

    return library() is not None
