"""The kernels a model runs on, as one object: the operations a layer needs (`KernelOps`), with one
implementation per family, and the resolver that picks the family for a device.

    ops = resolve_kernel_ops("auto", "cpu")   # NativeOps where the C kernels built, else TorchOps

  torch   `TorchOps`: plain torch; the reference everywhere and the fallback.
  native  `NativeOps`: the C kernels of `cpu_kernels` on the CPU, torch for the rest.
  triton  `TritonOps`: the Triton kernels of `kernels` on CUDA (on the CPU only in Triton's
          interpreter, to check them).
  deterministic  `DeterministicOps`: the native family with every reduction in a fixed order
          (`EngineConfig.deterministic`; CPU).

`EngineConfig.kernels` ("auto" or a family's name) chooses. This module is the one place that
tells the families apart by name; everything else calls the object it returns.
"""

from __future__ import annotations

from ..errors import ConfigError
from .base import KernelOps, RopeTables

KERNEL_CHOICES = ("auto", "torch", "triton", "native")


def resolve_kernel_ops(choice: str, device_type: str, deterministic: bool = False) -> KernelOps:
    """The family for a configured choice on a device type ("cpu", "cuda"), in deterministic
    mode or not; raises ConfigError naming why a forced family cannot run here."""
    from ..kernels import interpreting, triton_available

    def fail(message: str) -> ConfigError:
        return ConfigError(message, field="kernels")

    if choice not in KERNEL_CHOICES:
        raise fail(f"unknown kernels {choice!r}; choose one of {list(KERNEL_CHOICES)}")
    if deterministic:
        return _deterministic(choice, device_type)
    if choice == "auto":
        if device_type == "cuda":
            choice = "triton" if triton_available() else "torch"
        else:
            choice = "native" if device_type == "cpu" and native_available() else "torch"
    elif choice == "native":
        if device_type != "cpu":
            raise fail(f"kernels='native' are C kernels for the CPU, not for {device_type}")
        _require_native("kernels='native' unavailable", "kernels")
    elif choice == "triton":
        if not triton_available():
            raise fail("kernels='triton' but the triton package is not installed")
        if device_type != "cuda" and not interpreting():
            raise fail(
                "kernels='triton' on the CPU needs Triton's interpreter: set TRITON_INTERPRET=1 "
                "before starting (it is slow; meant for checking the kernels, not for serving)"
            )
    if choice == "native":
        from .native_ops import NativeOps

        return NativeOps()
    if choice == "triton":
        from .triton_ops import TritonOps

        return TritonOps()
    from .torch_ops import TorchOps

    return TorchOps()


def _require_native(what: str, field: str) -> None:
    """ConfigError "`what`: why", naming `field`, where the native CPU kernels did not build."""
    if not native_available():
        from ..cpu_kernels import unavailable_reason

        raise ConfigError(f"{what}: {unavailable_reason()}", field=field)


def native_available() -> bool:
    """Whether the native CPU kernels built (or were built before) on this machine."""
    from ..cpu_kernels import library

    return library() is not None


def _deterministic(choice: str, device_type: str) -> KernelOps:
    """The native deterministic family on the CPU; the Triton one on CUDA (or, for checking it,
    in Triton's interpreter on the CPU with kernels='triton')."""
    from ..kernels import interpreting, triton_available

    def fail(message: str, field: str = "deterministic") -> ConfigError:
        return ConfigError(message, field=field)

    on_triton = (device_type == "cuda" and choice in ("auto", "triton")) or (
        device_type == "cpu" and choice == "triton"
    )
    if on_triton:
        if not triton_available():
            raise fail("deterministic mode on CUDA runs Triton kernels: pip install triton")
        if device_type == "cpu" and not interpreting():
            raise fail(
                "kernels='triton' on the CPU needs Triton's interpreter: set TRITON_INTERPRET=1 "
                "before starting",
                "kernels",
            )
        from .deterministic_triton_ops import DeterministicTritonOps

        return DeterministicTritonOps()
    if device_type == "cuda":
        raise fail(
            f"deterministic mode on CUDA runs on the triton kernels, not {choice!r}", "kernels"
        )
    if device_type != "cpu":
        raise fail(f"deterministic mode runs on the CPU and on CUDA, not on {device_type}")
    if choice not in ("auto", "native"):
        raise fail(
            f"deterministic mode runs on the native or the triton kernels, not {choice!r}",
            "kernels",
        )
    _require_native("deterministic mode needs the native CPU kernels", "deterministic")
    from .deterministic_ops import DeterministicOps

    return DeterministicOps()


__all__ = ["KERNEL_CHOICES", "KernelOps", "RopeTables", "resolve_kernel_ops"]
