"""What every section of bench/gpu.py shares: the run's context (device, seed, budget, the copy
bandwidth once measured), progress logging, and the CUDA health check."""

from __future__ import annotations

import dataclasses
import sys
import time

import torch


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


class MissingKernel(Exception):
    """The kernel module (or one of its functions) does not exist yet."""


# --- the run's context ---------------------------------------------------------------------------


@dataclasses.dataclass
class Ctx:
    smoke: bool
    device: torch.device
    dtype: torch.dtype
    seed: int
    started: float
    budget_s: float
    engine_reserve_s: float  # timing in the kernels section stops this long before the budget
    kernel_package: str
    copy_gbs: float | None = None
    read_gbs: float | None = None
    flush: torch.Tensor | None = None
    counter: int = 0

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def elapsed(self) -> float:
        return time.perf_counter() - self.started

    def time_left(self) -> float:
        return self.budget_s - self.elapsed()

    def may_time_kernels(self) -> bool:
        return self.time_left() > self.engine_reserve_s

    def gen(self) -> torch.Generator:
        """A fresh generator for each case: fresh inputs, reproducible from the run's seed."""
        self.counter += 1
        g = torch.Generator(device=self.device)
        g.manual_seed(self.seed * 1000 + self.counter)
        return g

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def poison_next_alloc(self, nbytes: int) -> None:
        """Best effort: fill the caching allocator's next block of `nbytes` with 0xFF bytes (NaN for
        floats, -1 for integers) so an output element the kernel never writes shows up."""
        if not self.cuda or nbytes <= 0:
            return
        torch.cuda.empty_cache()
        t = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        t.fill_(255)
        del t


def cuda_healthy(device: torch.device) -> bool:
    """False once the CUDA context is unusable (a sticky error such as an illegal address)."""
    if device.type != "cuda":
        return True
    try:
        torch.cuda.synchronize(device)
        return (torch.ones(4, device=device) * 2).sum().item() == 8.0
    except Exception:
        return False
