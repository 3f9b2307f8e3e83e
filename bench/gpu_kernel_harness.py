"""What a kernel case of bench/gpu.py is built from: the Case record, loading a kernel module,
random inputs, the comparison against a reference (tolerances included) and CUDA-event timing."""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import math
import statistics
import time
from collections.abc import Callable

import torch

from bench.gpu_common import Ctx, MissingKernel

# Correctness tolerances on max |kernel - reference| / max |reference|.
TOL = {torch.float32: 1e-4, torch.float16: 4e-3, torch.bfloat16: 2e-2}


# --- timing --------------------------------------------------------------------------------------


def time_us(ctx: Ctx, fn: Callable[[], object], target_s: float | None = None) -> float:
    """Median time of one call in microseconds.

    CUDA: events around each call, the L2 cache flushed (a 512 MiB fill, ~0.15 ms) before each, so
    every call reads its inputs from HBM; the fill also keeps the GPU busy while the host launches
    the call, so launch overhead shorter than the fill stays out of the number (longer overhead, as
    a torch reference of many small ops has, counts: that is what eager costs).
    CPU (smoke): perf_counter, one call."""
    if not ctx.cuda:  # the interpreter is slow: one call (the correctness check compiled nothing)
        t = time.perf_counter()
        fn()
        return 1e6 * (time.perf_counter() - t)
    if ctx.flush is None:
        ctx.flush = torch.empty(512 << 20, dtype=torch.uint8, device=ctx.device)
    target_s = target_s or 0.15
    for _ in range(3):  # warm-up: JIT compile, autotune, allocator
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(3):
        ctx.flush.fill_(1)
        fn()
    torch.cuda.synchronize()
    est = (time.perf_counter() - t) / 3
    reps = int(min(200, max(10, target_s / max(est, 1e-6))))
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for i in range(reps):
        ctx.flush.fill_(1)
        starts[i].record()
        fn()
        ends[i].record()
    torch.cuda.synchronize()
    return 1e3 * statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends))


def timing(
    ctx: Ctx,
    tri: Callable,
    ref: Callable,
    nbytes: int,
    flops: float | None = None,
    extra: dict[str, Callable] | None = None,
) -> dict:
    """Time the kernel and its torch reference (and `extra` baselines); bandwidth and ratios."""
    if not ctx.may_time_kernels():
        return {"timing": "skipped (budget)"}
    out: dict = {"bytes": int(nbytes)}
    out["triton_us"] = time_us(ctx, tri)
    out["torch_us"] = time_us(ctx, ref)
    for name, fn in (extra or {}).items():
        out[f"{name}_us"] = time_us(ctx, fn)
    out["gbs"] = nbytes / out["triton_us"] / 1e3
    out["torch_gbs"] = nbytes / out["torch_us"] / 1e3
    if ctx.copy_gbs:
        out["frac_copy"] = out["gbs"] / ctx.copy_gbs
    out["speedup"] = out["torch_us"] / out["triton_us"]
    if flops:
        out["tflops"] = flops / out["triton_us"] / 1e6
        out["torch_tflops"] = flops / out["torch_us"] / 1e6
    return out


# --- comparisons ---------------------------------------------------------------------------------


def compare(out: torch.Tensor | None, ref: torch.Tensor | None, tol: float) -> dict:
    """Element by element: |out - ref| <= tol * (|ref| + rms(ref)) (relative, with an absolute floor
    at the reference's typical size for elements near zero), and every element the reference has
    finite is finite in `out` (NaN-poisoned, never written elements fail). Reports max abs error and
    rel = max abs error / max |ref|."""
    if ref is None or out is None:
        ok = ref is None and out is None
        return {
            "max_abs": 0.0,
            "max_rel": 0.0,
            "ok": ok,
            **({} if ok else {"why": "one output is None"}),
        }
    if tuple(out.shape) != tuple(ref.shape):
        return {
            "max_abs": math.inf,
            "max_rel": math.inf,
            "ok": False,
            "why": f"shape {tuple(out.shape)} != {tuple(ref.shape)}",
        }
    o, r = out.detach().double(), ref.detach().double()
    fin_r = torch.isfinite(r)
    bad = int((~torch.isfinite(o) & fin_r).sum())
    both = fin_r & torch.isfinite(o)
    diff, rb = (o - r).abs()[both], r[both]
    max_abs = float(diff.max()) if diff.numel() else 0.0
    scale = float(r[fin_r].abs().max()) if bool(fin_r.any()) else 0.0
    rms = float(rb.pow(2).mean().sqrt()) if rb.numel() else 0.0
    max_rel = max_abs / scale if scale > 0 else (0.0 if max_abs == 0 else math.inf)
    worst = (
        float((diff / (tol * (rb.abs() + rms))).nan_to_num(math.inf).max())
        if diff.numel() and max_abs
        else 0.0
    )
    res = {
        "max_abs": max_abs,
        "max_rel": max_rel,
        "ok": bad == 0 and worst <= 1.0,
        "tol": tol,
        "err_over_tol": worst,
    }
    if bad:
        res["why"] = f"{bad} non-finite where the reference is finite (unwritten?)"
    elif worst > 1.0:
        res["why"] = (
            f"error {worst:.2g}x the tolerance {tol:g} * (|ref| + rms ref) (max abs {max_abs:.3g})"
        )
    return res


def merge_cmp(parts: dict[str, dict]) -> dict:
    """Several compared outputs -> one summary (worst of each), why-messages named by output."""
    res = {
        "max_abs": max(p["max_abs"] for p in parts.values()),
        "max_rel": max(p["max_rel"] for p in parts.values()),
        "ok": all(p["ok"] for p in parts.values()),
    }
    whys = [f"{k}: {p['why']}" for k, p in parts.items() if p.get("why")]
    if whys:
        res["why"] = "; ".join(whys)
    return res


def rel_err(out: torch.Tensor, truth: torch.Tensor) -> float:
    o, t = out.detach().double(), truth.detach().double()
    scale = float(t.abs().max())
    err = float((o - t).abs().max())
    return err / scale if scale else err


def takes_kw(fn: Callable, name: str) -> bool:
    try:
        return name in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def dtype_name(dt: torch.dtype) -> str:
    return {
        torch.bfloat16: "bf16",
        torch.float16: "fp16",
        torch.float32: "fp32",
        torch.int8: "int8",
        torch.float8_e4m3fn: "fp8e4m3",
    }.get(dt, str(dt).removeprefix("torch."))


def esize(dt: torch.dtype) -> int:
    return torch.empty(0, dtype=dt).element_size()


# --- building a case -----------------------------------------------------------------------------


@dataclasses.dataclass
class Case:
    kernel: str
    label: str
    dtype: str
    run: Callable[[], dict]


def load_ops(ctx: Ctx, module: str, *names: str):
    """The module's functions, or MissingKernel naming what is not there yet."""
    full = f"{ctx.kernel_package}.{module}"
    try:
        m = importlib.import_module(full)
    except ModuleNotFoundError as e:
        if e.name and (e.name == full or full.startswith(e.name + ".")):
            raise MissingKernel(f"module {full} does not exist") from None
        raise
    missing = [n for n in names if not hasattr(m, n)]
    if missing:
        raise MissingKernel(f"{full} has no {', '.join(missing)}")
    return m


def randn(ctx: Ctx, g: torch.Generator, *shape: int, dtype=None, std: float = 1.0) -> torch.Tensor:
    x = torch.randn(*shape, generator=g, device=ctx.device, dtype=torch.float32)
    return (x * std).to(dtype or ctx.dtype)


def qkv_views(
    qkv: torch.Tensor, hq: int, hkv: int, d: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [T, Hq, D], k and v [T, Hkv, D] as the strided views into the fused qkv projection's output
    that the engine hands the kernels."""
    t = qkv.shape[0]
    q = qkv[:, : hq * d].view(t, hq, d)
    k = qkv[:, hq * d : (hq + hkv) * d].view(t, hkv, d)
    v = qkv[:, (hq + hkv) * d :].view(t, hkv, d)
    return q, k, v
