"""One-shot GPU check and timing of sluice's Triton kernels and of engine decode.

    python3 bench/gpu.py                       # on a CUDA machine: the whole run, < 5 minutes on an H200
    python3 bench/gpu.py --sections kernels    # a subset: device, kernels, engine, or units such as
    python3 bench/gpu.py --sections norm,sampling,engine:torch
    python3 bench/gpu.py --smoke               # no GPU needed: every section on the CPU, tiny shapes,
                                               # kernels in Triton's interpreter (< 1 minute)
    python3 bench/gpu.py --table-from bench/results/gpu.json   # print the table of an earlier run

It is meant to be run once, unattended: every kernel case and every engine variant is wrapped so a
failure is reported (in the table and the JSON) and the rest still runs. A CUDA error that kills
the context (an illegal address, say) is detected after the failing case, and the remaining work
continues in a fresh child process. `--budget-s` (default 240) is a soft limit: kernel timing stops
early enough to leave the engine section its share, past the budget kernel cases still check
correctness but skip timing and engine variants are skipped; a watchdog ends the run `--grace-s`
(default 40) after it with what was measured so far (the table and the JSON are written anyway).

Sections, in order:
  device   name, capability, torch / Triton / CUDA versions; device-to-device copy bandwidth (1 GiB
           tensor, CUDA events, median of 20 copies, bytes read + written) plus read-only (a sum)
           and write-only (a fill) rates for reference. The copy rate is the yardstick below.
  kernels  every kernel of sluice/engine/kernels/ against its torch reference on fresh random
           inputs at Llama-3-8B shapes (H=4096, I=14336, Hq=32, Hkv=8, D=128, vocab 128256;
           decode batches of 1 and 64, T=2048 tokens for the elementwise kernels), bfloat16, plus
           int8 and fp8 KV caches and int8 weights; max abs / rel error (max abs error / max
           |reference|) and pass/fail (element-wise |kernel - ref| <= tol * (|ref| + rms(ref)),
           tol 2e-2 in bfloat16; quantized caches within one quantization step; sampling by the
           allowed token sets, determinism and the empirical distribution), and where cheap the
           error of both against float64 (a wrong reference fails the case too). Then
           CUDA-event timing of the kernel and of its torch eager reference (warm-up, L2 flushed
           before each call, median), bytes moved per call (formula beside each case) -> GB/s and
           the fraction of the copy bandwidth, speedup over torch; TFLOP/s for int8_linear.
           Outputs are checked for full coverage: NaN-filled `out=` buffers where a kernel takes
           one, else the allocator's next block is filled with NaN bytes first (best effort).
  engine   LLMEngine on a Llama-3-8B-shaped model with random bf16 weights made on the GPU:
           variants triton / torch kernels, int8 weights, fp8 KV cache; batch 1 and 64, prompts of
           128 tokens, 64 timed decode steps after a few warm-up steps; even rows greedy (their
           tokens are compared across variants), odd rows sampled (temperature 0.8, top-k 50,
           top-p 0.95, seeded), so the sampling kernel runs too. Time per step against the
           HBM bound = bytes read per step (the weights, minus the embedding table of which a step
           reads only its rows, plus the KV cache read) / the measured copy bandwidth (bytes read +
           written per second, used as the rate for this read-only stream; the read-only rate is in
           the JSON too). Weight-only bound reported beside it.

Targets: memory-bound kernels (norm, activation, rotary, write_kv, decode attention, sampling,
int8_linear at small M) move bytes at >= 70% of the copy bandwidth; batch-1 decode runs within
1.3x of the HBM bound.

Prints the table last (progress goes to stderr) and writes bench/results/gpu.json (--json; a smoke
run writes gpu_smoke.json instead), also after each unit, so a killed run leaves its numbers.
Exit status: 0 when the run completed (failed checks are in the table, not in the status), 3 when
the watchdog ended it, 130 when interrupted, 1 on an error outside every case (a bug here).
"""

from __future__ import annotations

import os
import sys

# Triton decides at decoration time whether a kernel is compiled or interpreted: the switch must be
# set before anything imports a kernel module (importing torch does not import Triton).
if "--smoke" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import gc  # noqa: E402
import importlib  # noqa: E402
import inspect  # noqa: E402
import itertools  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import platform  # noqa: E402
import signal  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Callable  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script from a checkout without installing the package
    sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "bench" / "results" / "gpu.json"
SMOKE_RESULTS = RESULTS.with_name("gpu_smoke.json")  # a smoke run never overwrites the GPU's results

KERNEL_UNITS = ("norm", "activation", "rotary", "kv_cache", "paged_attention", "sampling", "int8_linear")
ENGINE_VARIANTS = {  # name -> EngineConfig fields
    "triton": {"kernels": "triton"},
    "torch": {"kernels": "torch"},
    "int8": {"kernels": "triton", "quantization": "int8"},
    "kv-fp8": {"kernels": "triton", "kv_cache_dtype": "fp8"},
    "kv-int8": {"kernels": "triton", "kv_cache_dtype": "int8"},
}
DEFAULT_ENGINE_VARIANTS = ("triton", "torch", "int8", "kv-fp8")
SMOKE_ENGINE_VARIANTS = ("triton", "torch", "int8", "kv-int8")  # fp8 KV caches are CUDA-only

# Correctness tolerances on max |kernel - reference| / max |reference|.
TOL = {torch.float32: 1e-4, torch.float16: 4e-3, torch.bfloat16: 2e-2}


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


# --- timing --------------------------------------------------------------------------------------

def time_us(ctx: Ctx, fn: Callable[[], object], target_s: float | None = None) -> float:
    """Median time of one call in microseconds.

    CUDA: events around each call, the L2 cache flushed (a 512 MiB fill, ~0.15 ms) before each, so
    every call reads its inputs from HBM; the fill also keeps the GPU busy while the host launches the
    call, so launch overhead shorter than the fill stays out of the number (longer overhead, as a
    torch reference of many small ops has, counts: that is what eager costs).
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


def timing(ctx: Ctx, tri: Callable, ref: Callable, nbytes: int, flops: float | None = None,
           extra: dict[str, Callable] | None = None) -> dict:
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
        return {"max_abs": 0.0, "max_rel": 0.0, "ok": ok, **({} if ok else {"why": "one output is None"})}
    if tuple(out.shape) != tuple(ref.shape):
        return {"max_abs": math.inf, "max_rel": math.inf, "ok": False,
                "why": f"shape {tuple(out.shape)} != {tuple(ref.shape)}"}
    o, r = out.detach().double(), ref.detach().double()
    fin_r = torch.isfinite(r)
    bad = int((~torch.isfinite(o) & fin_r).sum())
    both = fin_r & torch.isfinite(o)
    diff, rb = (o - r).abs()[both], r[both]
    max_abs = float(diff.max()) if diff.numel() else 0.0
    scale = float(r[fin_r].abs().max()) if bool(fin_r.any()) else 0.0
    rms = float(rb.pow(2).mean().sqrt()) if rb.numel() else 0.0
    max_rel = max_abs / scale if scale > 0 else (0.0 if max_abs == 0 else math.inf)
    worst = float((diff / (tol * (rb.abs() + rms))).nan_to_num(math.inf).max()) if diff.numel() and max_abs else 0.0
    res = {"max_abs": max_abs, "max_rel": max_rel, "ok": bad == 0 and worst <= 1.0, "tol": tol, "err_over_tol": worst}
    if bad:
        res["why"] = f"{bad} non-finite where the reference is finite (unwritten?)"
    elif worst > 1.0:
        res["why"] = f"error {worst:.2g}x the tolerance {tol:g} * (|ref| + rms ref) (max abs {max_abs:.3g})"
    return res


def merge_cmp(parts: dict[str, dict]) -> dict:
    """Several compared outputs -> one summary (worst of each), why-messages named by output."""
    res = {"max_abs": max(p["max_abs"] for p in parts.values()),
           "max_rel": max(p["max_rel"] for p in parts.values()),
           "ok": all(p["ok"] for p in parts.values())}
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
    return {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.int8: "int8",
            torch.float8_e4m3fn: "fp8e4m3"}.get(dt, str(dt).removeprefix("torch."))


def esize(dt: torch.dtype) -> int:
    return torch.empty(0, dtype=dt).element_size()


# --- kernel cases --------------------------------------------------------------------------------

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


def qkv_views(qkv: torch.Tensor, hq: int, hkv: int, d: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [T, Hq, D], k and v [T, Hkv, D] as the strided views into the fused qkv projection's output
    that the engine hands the kernels."""
    t = qkv.shape[0]
    q = qkv[:, : hq * d].view(t, hq, d)
    k = qkv[:, hq * d : (hq + hkv) * d].view(t, hkv, d)
    v = qkv[:, (hq + hkv) * d :].view(t, hkv, d)
    return q, k, v


# norm ------------------------------------------------------------------------------------------

def cases_norm(ctx: Ctx) -> list[Case]:
    m = load_ops(ctx, "norm", "add_rmsnorm_torch", "add_rmsnorm_triton")
    shapes = ([(4, 96, True), (3, 64, False)] if ctx.smoke else
              [(2048, 4096, True), (64, 4096, True), (2048, 4096, False)])
    dt = ctx.dtype

    def run(T: int, H: int, with_res: bool) -> dict:
        g = ctx.gen()
        x, res = randn(ctx, g, T, H), (randn(ctx, g, T, H) if with_res else None)
        w = (1 + 0.1 * torch.randn(H, generator=g, device=ctx.device)).to(dt)
        eps = 1e-5

        def args():
            return x.clone(), None if res is None else res.clone(), w, eps

        ref = m.add_rmsnorm_torch(*args())
        ctx.poison_next_alloc(T * H * esize(dt))
        out = m.add_rmsnorm_triton(*args())
        parts = {"normed": compare(out[0], ref[0], TOL[dt]), "residual": compare(out[1], ref[1], TOL[dt])}
        if takes_kw(m.add_rmsnorm_triton, "out"):  # the preallocated path, NaN-filled
            o2 = torch.full((T, H), float("nan"), dtype=dt, device=ctx.device)
            kw = {"out": o2}
            if with_res and takes_kw(m.add_rmsnorm_triton, "residual_out"):
                kw["residual_out"] = torch.full((T, H), float("nan"), dtype=dt, device=ctx.device)
            got = m.add_rmsnorm_triton(*args(), **kw)
            parts["normed(out=NaN)"] = compare(o2, ref[0], TOL[dt])
            parts["residual(out=NaN)"] = compare(got[1], ref[1], TOL[dt])
        r64 = x.double() + (res.double() if res is not None else 0)
        n64 = w.double() * r64 * torch.rsqrt(r64.pow(2).mean(-1, keepdim=True) + eps)
        f64 = {"triton": rel_err(out[0], n64), "torch": rel_err(ref[0], n64)}
        row = {**merge_cmp(parts), "vs_f64": f64}
        if f64["torch"] > TOL[dt]:
            row.update(ok=False, why=f"torch reference off float64 by {f64['torch']:.3g}")
        xt, rt = x.clone(), None if res is None else res.clone()
        # bytes: read x (+ residual) and the weight, write normed (+ residual_out)
        nbytes = ((4 if with_res else 2) * T * H + H) * esize(dt)
        row.update(timing(ctx, lambda: m.add_rmsnorm_triton(xt, rt, w, eps),
                          lambda: m.add_rmsnorm_torch(xt, rt, w, eps), nbytes))
        return row

    return [Case("add_rmsnorm", f"T={T} H={H}" + (" +res" if r else " no res"), dtype_name(dt),
                 lambda T=T, H=H, r=r: run(T, H, r)) for T, H, r in shapes]


# activation --------------------------------------------------------------------------------------

def cases_activation(ctx: Ctx) -> list[Case]:
    m = load_ops(ctx, "activation", "silu_and_mul_torch", "silu_and_mul_triton")
    shapes = [(3, 100)] if ctx.smoke else [(2048, 14336), (64, 14336)]
    dt = ctx.dtype

    def run(T: int, I: int) -> dict:  # noqa: E741
        g = ctx.gen()
        x = randn(ctx, g, T, 2 * I, std=2.0)
        ref = m.silu_and_mul_torch(x.clone())
        ctx.poison_next_alloc(T * I * esize(dt))
        out = m.silu_and_mul_triton(x.clone())
        parts = {"out": compare(out, ref, TOL[dt])}
        if takes_kw(m.silu_and_mul_triton, "out"):
            o2 = torch.full((T, I), float("nan"), dtype=dt, device=ctx.device)
            m.silu_and_mul_triton(x.clone(), out=o2)
            parts["out=NaN"] = compare(o2, ref, TOL[dt])
        x64 = x.double()
        t64 = torch.nn.functional.silu(x64[:, :I]) * x64[:, I:]
        f64 = {"triton": rel_err(out, t64), "torch": rel_err(ref, t64)}
        row = {**merge_cmp(parts), "vs_f64": f64}
        if f64["torch"] > TOL[dt]:
            row.update(ok=False, why=f"torch reference off float64 by {f64['torch']:.3g}")
        nbytes = 3 * T * I * esize(dt)  # read [T, 2I], write [T, I]
        row.update(timing(ctx, lambda: m.silu_and_mul_triton(x), lambda: m.silu_and_mul_torch(x), nbytes))
        return row

    return [Case("silu_and_mul", f"T={T} I={I}", dtype_name(dt), lambda T=T, I=I: run(T, I)) for T, I in shapes]


# rotary ----------------------------------------------------------------------------------------

def cases_rotary(ctx: Ctx) -> list[Case]:
    m = load_ops(ctx, "rotary", "rotary_torch_", "rotary_triton_")
    shapes = [(3, 6, 2, 64)] if ctx.smoke else [(2048, 32, 8, 128), (64, 32, 8, 128)]
    dt = ctx.dtype

    def angles(g, T: int, D: int) -> tuple[torch.Tensor, torch.Tensor]:
        pos = torch.randint(1, 8192, (T,), generator=g, device=ctx.device).float()
        inv = 1.0 / (500000.0 ** (torch.arange(0, D, 2, device=ctx.device).float() / D))
        a = pos[:, None] * inv[None, :]
        return a.cos(), a.sin()

    def run(T: int, Hq: int, Hkv: int, D: int) -> dict:
        g = ctx.gen()
        qkv = randn(ctx, g, T, (Hq + 2 * Hkv) * D)
        q, k, _ = qkv_views(qkv, Hq, Hkv, D)
        # Arbitrary cos/sin (not angles): every element then changes a lot, so one the kernel
        # skipped cannot pass for rotated (real angles leave the slow dimensions almost unchanged).
        cos = torch.rand(T, D // 2, generator=g, device=ctx.device) * 2 - 1
        sin = torch.rand(T, D // 2, generator=g, device=ctx.device) * 2 - 1
        qr, kr, _ = qkv_views(qkv.clone(), Hq, Hkv, D)
        qt, kt, _ = qkv_views(qkv.clone(), Hq, Hkv, D)
        m.rotary_torch_(qr, kr, cos, sin)
        m.rotary_triton_(qt, kt, cos, sin)
        row = merge_cmp({"q": compare(qt, qr, TOL[dt]), "k": compare(kt, kr, TOL[dt])})

        def truth(x, interleaved: bool):
            x, c, s = x.double(), cos.double()[:, None, :], sin.double()[:, None, :]
            if interleaved:
                x1, x2 = x[..., 0::2], x[..., 1::2]
                return torch.stack([x1 * c - x2 * s, x2 * c + x1 * s], -1).flatten(-2)
            x1, x2 = x.chunk(2, -1)
            return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], -1)

        errs = {name: max(rel_err(qr, truth(q, il)), rel_err(kr, truth(k, il)))
                for name, il in (("rotate_half", False), ("interleaved", True))}
        conv = min(errs, key=errs.get)
        f64 = {"convention": conv, "torch": errs[conv],
               "triton": max(rel_err(qt, truth(q, conv == "interleaved")), rel_err(kt, truth(k, conv == "interleaved")))}
        row["vs_f64"] = f64
        if errs[conv] > TOL[dt]:
            row.update(ok=False, why=f"torch reference matches neither convention in float64 ({errs})")
        c2, s2 = angles(g, T, D)
        qa, ka, _ = qkv_views(qkv.clone(), Hq, Hkv, D)
        qb, kb, _ = qkv_views(qkv.clone(), Hq, Hkv, D)
        # bytes: read + write q and k in place, read cos and sin (float32)
        nbytes = 2 * T * (Hq + Hkv) * D * esize(dt) + 2 * T * (D // 2) * 4
        row.update(timing(ctx, lambda: m.rotary_triton_(qa, ka, c2, s2), lambda: m.rotary_torch_(qb, kb, c2, s2), nbytes))
        return row

    return [Case("rotary_", f"T={T} Hq={Hq} Hkv={Hkv} D={D}", dtype_name(dt),
                 lambda a=(T, Hq, Hkv, D): run(*a)) for T, Hq, Hkv, D in shapes]


# KV cache ----------------------------------------------------------------------------------------

def make_cache(ctx: Ctx, g, shape, kind: str, fill_scale: float = 1.0):
    """A [num_blocks, Hkv, bs, D] cache of random content ("bf16"/model dtype, "int8", "fp8") and its
    per-(block, head) float32 scales (None for the model dtype)."""
    nb, hkv = shape[0], shape[1]
    if kind == "int8":
        c = torch.randint(-127, 128, shape, generator=g, device=ctx.device, dtype=torch.int8)
        s = (0.5 + torch.rand(nb, hkv, generator=g, device=ctx.device)) * fill_scale / 127
        return c, s
    if kind == "fp8":
        c = (torch.randn(shape, generator=g, device=ctx.device) * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
        s = (0.5 + torch.rand(nb, hkv, generator=g, device=ctx.device)) * fill_scale / 64
        return c, s
    return randn(ctx, g, *shape, std=fill_scale), None


def compare_quantized(a: torch.Tensor, sa: torch.Tensor, b: torch.Tensor, sb: torch.Tensor) -> dict:
    """Two quantized caches with their [num_blocks, Hkv] scales, dequantized, element by element:
    within one step of the larger scale (int8), or one e4m3 ulp (1/8 relative, 2^-9 of the scale
    near zero) for float8: rounding may differ, nothing else."""
    sa4, sb4 = sa.double()[:, :, None, None], sb.double()[:, :, None, None]
    x, y = a.double() * sa4, b.double() * sb4
    fin = torch.isfinite(y)
    bad = int((~torch.isfinite(x) & fin).sum())
    diff = (x - y).abs().nan_to_num(0.0)
    smax = torch.maximum(sa4, sb4)
    if a.dtype == torch.int8:
        allowed = 1.001 * smax
    else:
        allowed = 0.126 * torch.maximum(x.abs(), y.abs()).nan_to_num(0.0) + 2.0 ** -9 * smax
    worst = float((diff / allowed.clamp(min=1e-30)).max())
    scale = float(y[fin].abs().max()) if bool(fin.any()) else 0.0
    max_abs = float(diff.max())
    res = {"max_abs": max_abs, "max_rel": max_abs / scale if scale else max_abs, "ok": bad == 0 and worst <= 1.0,
           "err_over_tol": worst, "exact_fraction": float((a.view(torch.uint8) == b.view(torch.uint8)).double().mean())}
    if bad:
        res["why"] = f"{bad} non-finite where the reference is finite"
    elif worst > 1.0:
        res["why"] = f"differs by {worst:.2g}x one quantization step somewhere (max abs {max_abs:.3g})"
    return res


def slot_mapping_for(ctx: Ctx, g, seqs: list[tuple[int, int]], num_blocks: int, bs: int) -> torch.Tensor:
    """The slots a step writes for sequences (tokens already cached, new tokens), laid out as the
    engine does: each sequence owns distinct blocks scattered over the cache, fills them from
    offset 0 upward, and its new tokens are contiguous in the flat batch."""
    need = [-(-(c + n) // bs) for c, n in seqs]
    perm = torch.randperm(num_blocks, generator=g, device=ctx.device)
    out, used = [], 0
    for (c, n), nb in zip(seqs, need):
        table = perm[used : used + nb]
        used += nb
        pos = torch.arange(c, c + n, device=ctx.device)
        out.append(table[pos // bs] * bs + pos % bs)
    if used > num_blocks:
        raise ValueError("cache too small for the sequences")
    return torch.cat(out).to(torch.int64)


def cases_kv_cache(ctx: Ctx) -> list[Case]:
    m = load_ops(ctx, "kv_cache", "write_kv_torch", "write_kv_triton")
    hkv, bs, d = (2, 16, 32) if ctx.smoke else (8, 16, 128)
    kinds = ("bf16", "int8") + (("fp8",) if ctx.cuda else ())
    # (label, sequences as (tokens already cached, new tokens)): a decode step of many sequences,
    # and prefill chunks, some continuing a sequence part-way into a block
    if ctx.smoke:
        steps = [("decode N=3", None, 3, 1), ("prefill 2 seqs", [(3, 9), (0, 6)], 0, 0)]
    else:
        steps = [("decode N=64", None, 64, 1), ("prefill T=2048", [(0, 512), (37, 512), (0, 512), (500, 512)], 0, 0)]
    dt = ctx.dtype
    def run(seqs: list[tuple[int, int]] | None, n_dec: int, kind: str) -> dict:
        g = ctx.gen()
        if seqs is None:  # decodes: one new token each, after 0..300 cached ones
            seqs = [(int(c), 1) for c in torch.randint(0, 300, (n_dec,), generator=g, device=ctx.device)]
        T = sum(n for _, n in seqs)
        nb = sum(-(-(c + n) // bs) for c, n in seqs) + (4 if ctx.smoke else 1024)
        shape = (nb, hkv, bs, d)
        _, k, v = qkv_views(randn(ctx, g, T, (4 * hkv + 2 * hkv) * d), 4 * hkv, hkv, d)
        slots = slot_mapping_for(ctx, g, seqs, nb, bs)
        if kind == "bf16":
            # Poison: slots nobody writes stay NaN, in both; a slot the kernel misses stays NaN.
            kc0 = torch.full(shape, float("nan"), dtype=dt, device=ctx.device)
            vc0 = torch.full(shape, float("nan"), dtype=dt, device=ctx.device)
            ks0 = vs0 = None
        else:
            # Partly filled blocks with scales in use (some smaller than the new tokens need, so
            # the scale grows and old entries are requantized, some larger) and some fresh blocks.
            amax = float(torch.maximum(k.abs().max(), v.abs().max()))
            # old scales around what the new tokens need, so about half the blocks grow theirs
            fill = 0.6 * amax * (1 if kind == "int8" else 64 / 448)
            kc0, ks0 = make_cache(ctx, g, shape, kind, fill)
            vc0, vs0 = make_cache(ctx, g, shape, kind, fill)
            fresh = torch.rand(nb, generator=g, device=ctx.device) < 0.25
            for c, s in ((kc0, ks0), (vc0, vs0)):
                (c.view(torch.uint8) if c.dtype == torch.float8_e4m3fn else c)[fresh] = 0  # no fp8 fill
                s[fresh] = 0.0

        def state():
            return (kc0.clone(), vc0.clone(), None if ks0 is None else ks0.clone(),
                    None if vs0 is None else vs0.clone())

        kr, vr, ksr, vsr = state()
        m.write_kv_torch(k, v, kr, vr, slots, ksr, vsr)
        kt, vt, kst, vst = state()
        m.write_kv_triton(k, v, kt, vt, slots, kst, vst)
        blk, off = slots // bs, slots % bs

        def written(c, s):  # [T, Hkv, D] dequantized values at the written slots
            x = c[blk, :, off, :].double()
            return x if s is None else x * s[blk].double()[..., None]

        if kind == "bf16":
            parts = {}
            for name, a, b in (("k_cache", kt, kr), ("v_cache", vt, vr)):
                same_nan = bool(torch.equal(a.isnan(), b.isnan()))
                diff = float((a.double() - b.double()).nan_to_num(0).abs().max())
                parts[name] = {"max_abs": diff, "max_rel": diff, "ok": same_nan and diff == 0.0,
                               **({} if same_nan else {"why": "NaN pattern differs (a slot unwritten or written elsewhere)"})}
                if same_nan and diff:
                    parts[name]["why"] = f"a copy must be exact; differs by {diff:g}"
            row = merge_cmp(parts)
            f64 = {"triton": rel_err(written(kt, None), k), "torch": rel_err(written(kr, None), k)}
            row["vs_f64"] = f64
            if f64["torch"] != 0:
                row.update(ok=False, why="torch reference does not store k exactly")
        else:
            # whole caches (requantized old entries included), dequantized, and the scales
            parts = {}
            for name, a, sa, b, sb in (("k", kt, kst, kr, ksr), ("v", vt, vst, vr, vsr)):
                parts[name + "_scale"] = compare(sa, sb, 1e-6)
                parts[name + "_cache"] = compare_quantized(a, sa, b, sb)
            row = merge_cmp(parts)
            # float64: a written value is within half a step of the scale (int8), or 1/16 relative
            # (e4m3 round to nearest; 2^-10 of the scale absolute among subnormals), of what was written
            wk_t, wk_r = written(kt, kst), written(kr, ksr)
            err_t, err_r = (wk_t - k.double()).abs(), (wk_r - k.double()).abs()
            if kind == "int8":
                step = ksr[blk].double()[..., None]
                f64 = {"torch_steps": float((err_r / step).max()), "triton_steps": float((err_t / (kst[blk].double()[..., None])).max())}
                ref_ok = f64["torch_steps"] <= 0.5 + 1e-3
            else:
                scale_r = ksr[blk].double()[..., None]
                small = 2.0 ** -6 * scale_r  # e4m3's smallest normal: below it, half a 2^-9 step absolute
                f64 = {"torch_rel": float((err_r / (k.double().abs() + small)).max()),
                       "triton_rel": float((err_t / (k.double().abs() + small)).max())}
                ref_ok = f64["torch_rel"] <= 0.0625 + 1e-3
            row["vs_f64"] = f64
            # blocks continued part-way (first offset written > 0) whose K scale grew: requantized
            first = torch.full((nb,), bs, dtype=torch.int64, device=ctx.device).scatter_reduce(0, blk, off, "amin")
            cont = (first > 0) & (first < bs)
            grew = int(((ksr > ks0) & cont[:, None]).sum())
            row["note"] = f"{grew} of {int(cont.sum()) * hkv} continued (block, head) K scales grew"
            if not ref_ok:
                row.update(ok=False, why=f"torch reference: written values off what was written ({f64})")
        kc, vc, ksc, vsc = state()
        kc2, vc2, ksc2, vsc2 = state()
        elt_c = esize(kc0.dtype)
        # bytes: read k and v, write them into the cache, read the slot mapping (int64); a
        # quantized cache also reads/writes one scale per (token, head) (upper bound: requantized
        # old entries of a block whose scale grew are not counted)
        nbytes = 2 * T * hkv * d * (esize(dt) + elt_c) + T * 8 + (0 if kind == "bf16" else 2 * 2 * T * hkv * 4)
        row.update(timing(ctx, lambda: m.write_kv_triton(k, v, kc, vc, slots, ksc, vsc),
                          lambda: m.write_kv_torch(k, v, kc2, vc2, slots, ksc2, vsc2), nbytes))
        return row

    return [Case("write_kv", f"{label} Hkv={hkv} D={d} bs={bs} cache {kind}", dtype_name(dt),
                 lambda a=(seqs, n, kind): run(*a)) for kind in kinds for label, seqs, n, _ in steps]


# paged decode attention ---------------------------------------------------------------------------

def cases_paged_attention(ctx: Ctx) -> list[Case]:
    m = load_ops(ctx, "paged_attention", "paged_decode_attention_torch", "paged_decode_attention_triton")
    hq, hkv, d, bs = (4, 2, 32, 16) if ctx.smoke else (32, 8, 128, 16)
    kinds = ("bf16", "int8") + (("fp8",) if ctx.cuda else ())
    # (batch, min len, max len, sliding window)
    if ctx.smoke:
        shapes = [(2, 5, 50, None)]
        extra = [(2, 20, 60, 24, "bf16")]
    else:
        shapes = [(1, 4096, 4096, None), (64, 512, 1536, None)]
        extra = [(64, 512, 1536, 256, "bf16"), (1, 32768, 32768, None, "bf16")]
    dt = ctx.dtype

    def run(N: int, lo: int, hi: int, window: int | None, kind: str) -> dict:
        g = ctx.gen()
        lens = torch.randint(lo, hi + 1, (N,), generator=g, device=ctx.device)
        nblk = (lens + bs - 1) // bs
        nb = int(nblk.sum()) + 8
        maxb = int(nblk.max())
        # distinct blocks for each sequence, scattered over the cache; padding entries hold other
        # (valid) block ids, which the kernel must not attend to
        perm = torch.randperm(nb, generator=g, device=ctx.device)
        tables = torch.randint(0, nb, (N, maxb), generator=g, device=ctx.device)
        starts = torch.cumsum(nblk, 0) - nblk
        col = torch.arange(maxb, device=ctx.device)
        used = col[None, :] < nblk[:, None]
        tables[used] = perm[(starts[:, None] + col[None, :])[used]]
        tables = tables.to(torch.int32)
        seq_lens = lens.to(torch.int32)
        q, _, _ = qkv_views(randn(ctx, g, N, (hq + 2 * hkv) * d), hq, hkv, d)
        kc, ks = make_cache(ctx, g, (nb, hkv, bs, d), kind)
        vc, vs = make_cache(ctx, g, (nb, hkv, bs, d), kind)
        scale = d ** -0.5
        args = (q, kc, vc, tables, seq_lens, scale, ks, vs, window)
        # the engine knows the longest context on the host: passing it spares the wrapper a sync
        kw = {"max_seq_len": int(lens.max())} if takes_kw(m.paged_decode_attention_triton, "max_seq_len") else {}
        ref = m.paged_decode_attention_torch(*args)
        ctx.poison_next_alloc(N * hq * d * esize(dt))
        out = m.paged_decode_attention_triton(*args, **kw)
        tol = TOL[dt] * (1.5 if kind != "bf16" else 1.0)
        parts = {"out": compare(out, ref, tol)}
        if takes_kw(m.paged_decode_attention_triton, "out"):
            o2 = torch.full((N, hq, d), float("nan"), dtype=dt, device=ctx.device)
            m.paged_decode_attention_triton(*args, out=o2, **kw)
            parts["out=NaN"] = compare(o2, ref, tol)
        row = merge_cmp(parts)
        # float64 truth, one sequence at a time (a bench, not a reference implementation)
        errs = []
        check = range(N) if N <= 8 else range(0, N, max(1, N // 8))
        for i in check:
            L = int(lens[i])
            blocks = tables[i, : int(nblk[i])].long()

            def ctx_of(c, s):
                x = c[blocks].double()
                if s is not None:
                    x = x * s[blocks].double()[:, :, None, None]
                return x.permute(1, 0, 2, 3).reshape(hkv, -1, d)[:, :L]

            K, V = ctx_of(kc, ks), ctx_of(vc, vs)
            first = max(0, L - window) if window else 0
            K, V = K[:, first:], V[:, first:]
            qi = q[i].double().view(hkv, hq // hkv, d)
            p = torch.softmax(qi @ K.transpose(1, 2) * scale, -1)
            t = (p @ V).reshape(hq, d)
            scale_i = float(t.abs().max())
            errs.append((float((out[i].double() - t).abs().max()) / scale_i, float((ref[i].double() - t).abs().max()) / scale_i))
        f64 = {"triton": max(e[0] for e in errs), "torch": max(e[1] for e in errs), "seqs_checked": len(errs)}
        row["vs_f64"] = f64
        if f64["torch"] > tol:
            row.update(ok=False, why=f"torch reference off float64 by {f64['torch']:.3g}")
        attended = (lens.clamp(max=window) if window else lens)
        # bytes: read q, write out, read the attended K and V (whole blocks), the block tables and
        # seq_lens, and for a quantized cache one K and one V scale per (block, KV head) read
        blocks_read = int(((attended + bs - 1) // bs).sum()) + (N if window else 0)
        nbytes = (2 * N * hq * d * esize(dt) + 2 * blocks_read * hkv * bs * d * esize(kc.dtype)
                  + N * maxb * 4 + N * 4 + (0 if ks is None else 2 * blocks_read * hkv * 4))
        row.update(timing(ctx, lambda: m.paged_decode_attention_triton(*args, **kw),
                          lambda: m.paged_decode_attention_torch(*args), nbytes))
        row["note"] = f"ctx {int(lens.min())}-{int(lens.max())}" + (f" win {window}" if window else "")
        return row

    cases = [Case("paged_decode_attn", f"N={N} Hq={hq} Hkv={hkv} D={d} L={lo}-{hi} kv {kind}", dtype_name(dt),
                  lambda a=(N, lo, hi, w, kind): run(*a)) for kind in kinds for N, lo, hi, w in shapes]
    cases += [Case("paged_decode_attn", f"N={N} L={lo}-{hi}" + (f" win={w}" if w else "") + f" kv {kind}",
                   dtype_name(dt), lambda a=(N, lo, hi, w, kind): run(*a)) for N, lo, hi, w, kind in extra]
    return cases


# sampling ----------------------------------------------------------------------------------------

def sampling_params(ctx: Ctx, g, N: int, V: int):
    """Mixed rows: greedy, plain, top-k, top-p, min-p, all three (0 / 1.0 / 0.0 switch a filter off)."""
    kinds = [(0.0, 0, 1.0, 0.0), (1.0, 0, 1.0, 0.0), (0.8, 50, 1.0, 0.0), (1.0, 0, 0.9, 0.0),
             (1.0, 0, 1.0, 0.05), (0.7, 100, 0.95, 0.02)]
    rows = [kinds[(i + ctx.seed) % len(kinds)] for i in range(N)]
    dev = ctx.device
    temp = torch.tensor([r[0] for r in rows], dtype=torch.float32, device=dev)
    top_k = torch.tensor([min(r[1], V) for r in rows], dtype=torch.int32, device=dev)
    top_p = torch.tensor([r[2] for r in rows], dtype=torch.float32, device=dev)
    min_p = torch.tensor([r[3] for r in rows], dtype=torch.float32, device=dev)
    seeds = torch.randint(0, 2**62, (N,), generator=g, device=dev, dtype=torch.int64)
    return temp, top_k, top_p, min_p, seeds


def allowed_tokens(logits: torch.Tensor, temp, top_k, top_p, min_p) -> torch.Tensor:
    """[N, V] bool, float64: tokens a correct sampler may return (greedy rows: the argmax alone).
    Lenient at the edges: top-p on the whole distribution (keeps at least what top-p after top-k
    keeps), ties and a 1e-6 slack at each cut-off."""
    x = logits.double()
    n, v = x.shape
    greedy = temp == 0
    t = torch.where(greedy, torch.ones_like(temp), temp).double()[:, None]
    p = torch.softmax(x / t, -1)
    sp, _ = p.sort(-1, descending=True)
    k = torch.where(top_k > 0, top_k, v).long().clamp(1, v)
    kth = sp.gather(1, (k - 1)[:, None])
    ok = p >= kth * (1 - 1e-6)
    before = sp.cumsum(-1) - sp  # mass strictly above each sorted position
    keep_sorted = before < top_p.double()[:, None] + 1e-6
    last = keep_sorted.sum(-1, keepdim=True).clamp(min=1)
    pcut = sp.gather(1, last - 1)
    ok &= p >= pcut * (1 - 1e-6)
    ok &= p >= min_p.double()[:, None] * sp[:, :1] * (1 - 1e-6)
    am = torch.zeros_like(ok)
    am[torch.arange(n, device=x.device), x.argmax(-1)] = True
    return torch.where(greedy[:, None], am, ok)


def cases_sampling(ctx: Ctx) -> list[Case]:
    m = load_ops(ctx, "sampling", "sample_torch", "sample_triton")
    shapes = [(1, 1000), (3, 517)] if ctx.smoke else [(1, 128256), (64, 128256)]

    def run(N: int, V: int) -> dict:
        g = ctx.gen()
        logits = torch.randn(N, V, generator=g, device=ctx.device) * 3
        temp, top_k, top_p, min_p, seeds = sampling_params(ctx, g, N, V)
        args = (logits, temp, top_k, top_p, min_p, seeds)
        ref = m.sample_torch(*args)
        ctx.poison_next_alloc(N * 8)
        out = m.sample_triton(*args)
        again = m.sample_triton(*args)
        allowed = allowed_tokens(logits, temp, top_k, top_p, min_p)
        why = []
        if out.shape != (N,) or out.dtype != torch.int64:
            why.append(f"output {tuple(out.shape)} {out.dtype}, want ({N},) int64")
        inrange = bool(((out >= 0) & (out < V)).all())
        if not inrange:
            why.append("token outside [0, V) (unwritten?)")
        rows = torch.arange(N, device=ctx.device)
        ok_t = inrange and bool(allowed[rows, out.clamp(0, V - 1)].all())
        ok_r = bool(allowed[rows, ref.clamp(0, V - 1)].all())
        if inrange and not ok_t:
            why.append("a token outside its row's top-k / top-p / min-p set (or not the argmax)")
        if not ok_r:
            why.append("torch reference drew a token outside the allowed set")
        if not torch.equal(out, again):
            why.append("not deterministic for the same seeds")
        agree = float((out == ref).float().mean())
        # no error to report: the two samplers draw differently by design (same distribution)
        row = {"ok": not why, "max_abs": None, "max_rel": None, "agree_with_torch": agree,
               "note": f"same token as torch {agree:.0%} (not required)"}
        if why:
            row["why"] = "; ".join(why)
        # bytes: read the logits once and the per-row parameters, write one int64 per row
        nbytes = N * V * 4 + N * (4 * 4 + 8) + N * 8
        row.update(timing(ctx, lambda: m.sample_triton(*args), lambda: m.sample_torch(*args), nbytes))
        return row

    def run_distribution(N: int, V: int, topk: int, temperature: float) -> dict:
        """Many rows of one distribution concentrated on 20 tokens: the empirical frequencies of
        both samplers against the exact truncated softmax (total variation distance)."""
        g = ctx.gen()
        row_logits = torch.full((V,), -30.0, device=ctx.device)
        hot = torch.randperm(V, generator=g, device=ctx.device)[:20]
        row_logits[hot] = torch.randn(20, generator=g, device=ctx.device) * 0.5
        logits = row_logits.expand(N, V).contiguous()
        temp = torch.full((N,), temperature, device=ctx.device)
        top_k = torch.full((N,), topk, dtype=torch.int32, device=ctx.device)
        top_p = torch.ones(N, device=ctx.device)
        min_p = torch.zeros(N, device=ctx.device)
        seeds = torch.randint(0, 2**62, (N,), generator=g, device=ctx.device, dtype=torch.int64)
        p = torch.softmax(row_logits.double() / temperature, -1)
        if topk:
            kth = p.sort(descending=True).values[topk - 1]
            p = torch.where(p >= kth, p, 0.0)
            p = p / p.sum()
        tv, res = {}, {}
        outside = {}
        for name, fn in (("triton", m.sample_triton), ("torch", m.sample_torch)):
            tok = fn(logits, temp, top_k, top_p, min_p, seeds)
            freq = torch.bincount(tok.clamp(0, V - 1), minlength=V).double() / N
            tv[name] = 0.5 * float((freq - p).abs().sum())
            # a draw outside the kept set (beyond top-k, or a -30 logit) is wrong however rare
            outside[name] = int(((tok < 0) | (tok >= V)).sum()) + int(torch.bincount(tok.clamp(0, V - 1), minlength=V)[p == 0].sum())
        # expected TV of an exact sampler ~ 0.5 * sum sqrt(2 p (1-p) / (pi N)); allow 3x that
        expect = 0.5 * float(torch.sqrt(2 * p * (1 - p) / (math.pi * N)).sum())
        limit = 3 * expect + 0.01
        res.update(ok=tv["triton"] <= limit and tv["torch"] <= limit and not any(outside.values()),
                   max_abs=None, max_rel=None, tv=tv, tv_limit=limit, outside_support=outside,
                   note=f"TV triton {tv['triton']:.3f} torch {tv['torch']:.3f} (limit {limit:.3f})")
        if any(outside.values()):
            res["why"] = f"draws outside the kept tokens: {outside}"
        elif not res["ok"]:
            res["why"] = f"empirical distribution off: TV {tv} > {limit:.3f}"
        return res

    cases = [Case("sample", f"N={N} V={V} mixed params", "fp32", lambda N=N, V=V: run(N, V)) for N, V in shapes]
    # The interpreter runs a program per row: the smoke run keeps this check small (weak statistics).
    nd, vd = (48, 32) if ctx.smoke else (16384, 1000)
    cases.append(Case("sample", f"distribution N={nd} V={vd} T=0.7 top_k=8", "fp32",
                      lambda: run_distribution(nd, vd, 8, 0.7)))
    if not ctx.smoke:
        cases.append(Case("sample", f"distribution N={nd} V={vd} T=1", "fp32",
                          lambda: run_distribution(nd, vd, 0, 1.0)))
    return cases


# int8 linear -----------------------------------------------------------------------------------

def cases_int8_linear(ctx: Ctx) -> list[Case]:
    m = load_ops(ctx, "int8_linear", "quantize_int8", "int8_linear_torch", "int8_linear_triton")
    if ctx.smoke:
        layers = {"a": (48, 64), "b": (40, 100)}
        plan = [("a", 1, True), ("b", 33, False)]
    else:
        layers = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
        plan = ([(n, 1, False) for n in layers] + [(n, 64, False) for n in layers]
                + [("gate_up", 2048, False), ("down", 2048, False), ("qkv", 64, True)])
    dt = ctx.dtype
    weights: dict[str, tuple] = {}

    def weight(name: str):
        if name not in weights:
            weights.clear()  # one layer's weights at a time
            g = ctx.gen()
            N, K = layers[name]
            w = randn(ctx, g, N, K, std=0.02)
            q, s = m.quantize_int8(w)
            weights[name] = (w, q, s)
        return weights[name]

    def run(name: str, M: int, with_bias: bool) -> dict:
        N, K = layers[name]
        w, q, s = weight(name)
        g = ctx.gen()
        x = randn(ctx, g, M, K)
        bias = randn(ctx, g, N, std=0.1) if with_bias else None
        why = []
        # the quantizer: int8 in [-127, 127], one float32 scale per row, |q * s - w| <= s / 2
        qerr = float(((q.double() * s.double()[:, None] - w.double()).abs() / s.double()[:, None]).max())
        if q.dtype != torch.int8 or tuple(q.shape) != (N, K) or tuple(s.shape) != (N,):
            why.append(f"quantize_int8 gave {q.dtype} {tuple(q.shape)} / {tuple(s.shape)}")
        elif int(q.min()) < -127 or qerr > 0.5 + 1e-3:
            why.append(f"quantize_int8: error {qerr:.3f} steps (> 0.5) or -128 used")
        ref = m.int8_linear_torch(x, q, s, bias)
        ctx.poison_next_alloc(M * N * esize(dt))
        out = m.int8_linear_triton(x, q, s, bias)
        tol = 2e-2 if dt == torch.bfloat16 else TOL[dt] * 4
        parts = {"out": compare(out, ref, tol)}
        if takes_kw(m.int8_linear_triton, "out"):
            o2 = torch.full((M, N), float("nan"), dtype=dt, device=ctx.device)
            m.int8_linear_triton(x, q, s, bias, out=o2)
            parts["out=NaN"] = compare(o2, ref, tol)
        row = merge_cmp(parts)
        row["memory_bound"] = M < 256  # 2 M FLOP per weight byte: compute-bound from a few hundred rows
        t64 = x.double() @ (q.double() * s.double()[:, None]).T
        if bias is not None:
            t64 = t64 + bias.double()
        f64 = {"triton": rel_err(out, t64), "torch": rel_err(ref, t64), "quant_steps": qerr}
        row["vs_f64"] = f64
        if f64["torch"] > tol:
            why.append(f"torch reference off float64 by {f64['torch']:.3g}")
        if why:
            row.update(ok=False, why="; ".join(why + ([row["why"]] if row.get("why") else [])))
        # bytes: read x, the int8 weight and its scales (and bias), write the output
        nbytes = M * K * esize(dt) + N * K + N * 4 + M * N * esize(dt) + (N * esize(dt) if with_bias else 0)
        dense = torch.nn.functional.linear
        row.update(timing(ctx, lambda: m.int8_linear_triton(x, q, s, bias), lambda: m.int8_linear_torch(x, q, s, bias),
                          nbytes, flops=2.0 * M * N * K, extra={"dense_bf16": lambda: dense(x, w, bias)}))
        if "dense_bf16_us" in row:
            row["note"] = f"x{row['dense_bf16_us'] / row['triton_us']:.2f} vs dense {dtype_name(dt)}"
            if M >= 256:
                row["note"] += f", {row['tflops']:.0f} TFLOP/s"
        return row

    return [Case("int8_linear", f"{name} M={M} N={layers[name][0]} K={layers[name][1]}" + (" +bias" if b else ""),
                 dtype_name(dt), lambda a=(name, M, b): run(*a)) for name, M, b in plan]


KERNEL_CASES = {
    "norm": cases_norm, "activation": cases_activation, "rotary": cases_rotary, "kv_cache": cases_kv_cache,
    "paged_attention": cases_paged_attention, "sampling": cases_sampling, "int8_linear": cases_int8_linear,
}


# --- device facts and bandwidth -------------------------------------------------------------------

def device_facts(ctx: Ctx) -> dict:
    facts: dict = {"torch": torch.__version__, "python": platform.python_version(), "device": str(ctx.device),
                   "smoke": ctx.smoke, "triton_interpret": os.environ.get("TRITON_INTERPRET") == "1"}
    try:
        import triton

        facts["triton"] = triton.__version__
    except Exception as e:  # noqa: BLE001
        facts["triton"] = f"unavailable ({e})"
    if ctx.cuda:
        p = torch.cuda.get_device_properties(ctx.device)
        facts.update(name=p.name, capability=f"{p.major}.{p.minor}", sms=p.multi_processor_count,
                     memory_gib=round(p.total_memory / 2**30, 1), cuda=torch.version.cuda)
        facts["l2_mib"] = round(getattr(p, "L2_cache_size", 0) / 2**20, 1)
        try:
            q = subprocess.run(["nvidia-smi", "--query-gpu=driver_version,clocks.sm,clocks.max.sm,clocks.mem,"
                                "power.limit,temperature.gpu", "--format=csv,noheader"],
                               capture_output=True, text=True, timeout=10)
            facts["nvidia_smi"] = q.stdout.strip()
        except Exception as e:  # noqa: BLE001
            facts["nvidia_smi"] = f"unavailable ({type(e).__name__})"
    else:
        facts.update(name=platform.processor() or platform.machine(), cpus=os.cpu_count())
    return facts


def bandwidth(ctx: Ctx) -> dict:
    """Device-to-device copy (bytes read + written per second), read-only (a sum) and write-only (a
    fill) rates, each the median of many runs."""
    nbytes = (16 << 20) if ctx.smoke else (1 << 30)
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=ctx.device) if ctx.smoke else \
        torch.empty(nbytes, dtype=torch.uint8, device=ctx.device).random_(0, 255)
    dst = torch.empty_like(src)
    as_f32 = src.view(torch.float32)
    res = {"bytes": nbytes}
    for name, fn, moved in (("copy", lambda: dst.copy_(src), 2 * nbytes),
                            ("read", lambda: as_f32.sum(), nbytes),
                            ("write", lambda: dst.fill_(7), nbytes)):
        if ctx.cuda:
            for _ in range(3):
                fn()
            torch.cuda.synchronize()
            ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(20)]
            for s, e in ev:
                s.record()
                fn()
                e.record()
            torch.cuda.synchronize()
            ms = statistics.median(s.elapsed_time(e) for s, e in ev)
        else:
            fn()
            ts = []
            for _ in range(5):
                t = time.perf_counter()
                fn()
                ts.append(time.perf_counter() - t)
            ms = 1e3 * statistics.median(ts)
        res[f"{name}_ms"] = ms
        res[f"{name}_gbs"] = moved / ms / 1e6
    return res


# --- engine decode --------------------------------------------------------------------------------

def llama3_8b_config(smoke: bool):
    from sluice.engine.config import ModelConfig

    if smoke:
        return ModelConfig(architecture="llama", vocab_size=512, hidden_size=128, intermediate_size=256,
                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                           rms_norm_eps=1e-5, rope_theta=500000.0, rope_scaling=None, max_position_embeddings=1024,
                           tie_word_embeddings=False, attention_bias=False, bos_token_id=None, eos_token_ids=(0,))
    return ModelConfig(architecture="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                       num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                       rms_norm_eps=1e-5, rope_theta=500000.0, rope_scaling=None, max_position_embeddings=8192,
                       tie_word_embeddings=False, attention_bias=False, bos_token_id=128000,
                       eos_token_ids=(128001, 128009))


def random_loaded_model(config, device: torch.device, dtype: torch.dtype, seed: int):
    """A LoadedModel of random HF-named tensors made directly on the device (same seed: same
    weights), std 0.02 for matrices, ~1 for norm weights."""
    from sluice.engine.loader import LoadedModel
    from sluice.engine.loader.tensor_names import expected_shapes

    g = torch.Generator(device=device)
    g.manual_seed(seed)
    tensors = {}
    for name, shape in expected_shapes(config).items():
        t = torch.empty(shape, dtype=dtype, device=device)
        if name.endswith("norm.weight"):
            t.normal_(1.0, 0.05, generator=g)
        else:
            t.normal_(0.0, 0.02, generator=g)
        tensors[name] = t
    return LoadedModel(config=config, tensors=tensors, tokenizer=None, source="random Llama-3-8B-shaped weights")


def bytes_read_per_step(model, batch: int) -> dict:
    """Weights a decode step reads: every parameter and buffer once (shared ones counted once),
    except the embedding table (only `batch` of its rows) and the rotary tables (a few rows)."""
    seen, total, embed = set(), 0, 0
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if t.is_mkldnn:
            key, nbytes = id(t), t.numel() * t.element_size()
        else:
            key, nbytes = (t.data_ptr(), t.numel()), t.numel() * t.element_size()
        if key in seen:
            continue
        seen.add(key)
        if "rotary" in name or "inv_freq" in name or "cos" in name or "sin" in name:
            continue
        if name.startswith("embed_tokens."):
            embed += nbytes
            continue
        total += nbytes
    # a tied head reads the whole table anyway: then it was counted under the head's name already
    rows = batch * model.config.hidden_size * 2
    return {"weights": total + min(rows, embed), "embedding_table": embed}


def engine_config_for(ctx: Ctx, variant: str, kv_bytes: int):
    from sluice.engine.config import EngineConfig

    fields = {f.name for f in dataclasses.fields(EngineConfig)}
    want = dict(ENGINE_VARIANTS[variant])
    missing = [k for k in want if k not in fields]
    if missing:
        raise MissingKernel(f"EngineConfig has no field {', '.join(missing)}")
    return EngineConfig(device=str(ctx.device), dtype="bfloat16", kv_cache_bytes=kv_bytes,
                        max_num_batched_tokens=2048 if not ctx.smoke else 256, **want)


def engine_variant(ctx: Ctx, variant: str, batches: tuple[int, ...], prompt_len: int, steps: int,
                   warm: int, tokens_seen: dict) -> list[dict]:
    from sluice.engine import LLMEngine

    cfg = llama3_8b_config(ctx.smoke)
    per_token = cfg.kv_bytes_per_token(2)
    max_tokens = warm + steps + 24
    kv_bytes = int(1.25 * max(batches) * (prompt_len + max_tokens + 32) * per_token) + (8 << 20)
    econf = engine_config_for(ctx, variant, kv_bytes)
    gc.collect()  # what an earlier variant (or its failure) left behind
    if ctx.cuda:
        torch.cuda.empty_cache()
    t0 = time.perf_counter()
    engine = LLMEngine(config=econf, loaded=random_loaded_model(cfg, ctx.device, torch.bfloat16, ctx.seed))
    ctx.sync()
    build_s = time.perf_counter() - t0
    log(f"  engine {variant}: built in {build_s:.1f} s (kernels {getattr(engine, 'kernels', '?')})")
    rows = []
    try:
        model = engine.runner.model
        kv_per_token = sum(c.nbytes if hasattr(c, "nbytes") else sum(t.numel() * t.element_size() for t in c)
                           for c in engine.runner.kv_caches) / max(1, engine.runner.num_blocks * econf.block_size)
        for batch in batches:
            if ctx.time_left() < (2 if ctx.smoke else 10):
                rows.append({"variant": variant, "batch": batch, "status": "skipped", "why": "budget"})
                continue
            row = {"variant": variant, "batch": batch, "build_s": build_s,
                   "kernels": getattr(engine, "kernels", None), "config": ENGINE_VARIANTS[variant]}
            try:
                row.update(decode_run(ctx, engine, batch, prompt_len, steps, warm, max_tokens, cfg.vocab_size))
            except Exception as e:  # noqa: BLE001
                row.update(status="error", why=f"{type(e).__name__}: {e}", traceback=traceback.format_exc(limit=8))
                rows.append(row)
                if not cuda_healthy(ctx.device):
                    raise
                continue
            w = bytes_read_per_step(model, batch)
            kv_read = row["mean_context"] * batch * kv_per_token
            row.update(weight_bytes=w["weights"], embedding_table_bytes=w["embedding_table"], kv_read_bytes=kv_read)
            if ctx.copy_gbs:
                row["bound_w_ms"] = w["weights"] / ctx.copy_gbs / 1e6
                row["bound_ms"] = (w["weights"] + kv_read) / ctx.copy_gbs / 1e6
                row["x_bound"] = row["ms_per_step"] / row["bound_ms"]
                row["x_bound_w"] = row["ms_per_step"] / row["bound_w_ms"]
                if ctx.read_gbs:
                    row["bound_read_bw_ms"] = (w["weights"] + kv_read) / ctx.read_gbs / 1e6
            first = row.pop("first_tokens")
            if variant == "triton":
                tokens_seen[batch] = first
            elif batch in tokens_seen and variant == "torch":
                ref = tokens_seen[batch]
                # greedy rows: token 1 comes from the prefill, token 2 from the first decode step
                pairs = list(zip(first, ref))[::2]
                same1 = sum(a[:1] == b[:1] for a, b in pairs)
                same2 = sum(a[:2] == b[:2] for a, b in pairs)
                row["greedy_agree_with_triton"] = {"token1": same1 / len(pairs), "tokens1_2": same2 / len(pairs)}
                row["note"] = f"greedy tokens = triton's: 1st {same1}/{len(pairs)}, 1st+2nd {same2}/{len(pairs)}"
            rows.append(row)
            log(f"  engine {variant} batch {batch}: {row['ms_per_step']:.2f} ms/step"
                + (f", {row['x_bound']:.2f}x the bound" if "x_bound" in row else ""))
    finally:
        del engine
        gc.collect()
        if ctx.cuda:
            torch.cuda.empty_cache()
    return rows


def decode_run(ctx: Ctx, engine, batch: int, prompt_len: int, steps: int, warm: int, max_tokens: int, vocab: int) -> dict:
    """`batch` random prompts through prefill, then `warm` + `steps` decode steps of the whole batch;
    per-step wall time (the step returns token ids to the host, so it ends synchronized)."""
    from sluice.engine.sampling_params import SamplingParams

    g = torch.Generator().manual_seed(ctx.seed + batch)
    prompts = torch.randint(0, vocab, (batch, prompt_len), generator=g).tolist()
    greedy = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)

    def params(i: int) -> SamplingParams:
        """Even rows greedy (comparable across variants), odd rows sampled (the sampling kernel)."""
        if i % 2 == 0:
            return greedy
        return SamplingParams(temperature=0.8, top_p=0.95, top_k=50, seed=ctx.seed + i, max_tokens=max_tokens,
                              ignore_eos=True)

    ids = [engine.add_request(f"d{batch}-{i}-{ctx.counter}", prompt_token_ids=p, params=params(i))
           for i, p in enumerate(prompts)]
    ctx.counter += 1
    produced = {rid: [] for rid in ids}
    t0 = time.perf_counter()
    prefill_steps = 0
    try:
        while any(not v for v in produced.values()):
            for out in engine.step():
                if out.request_id in produced:
                    produced[out.request_id] += out.new_token_ids
            prefill_steps += 1
            if prefill_steps > 1000:
                raise RuntimeError("prefill did not finish in 1000 steps")
        ctx.sync()
        prefill_s = time.perf_counter() - t0
        times, ctx_sum, budget_cut = [], 0, False
        for i in range(warm + steps):
            if i >= warm and ctx.time_left() < 0 and len(times) >= 8:
                budget_cut = True
                break
            ctx.sync()
            t = time.perf_counter()
            outs = engine.step()
            ctx.sync()
            dt = time.perf_counter() - t
            n_new = 0
            for out in outs:
                if out.request_id in produced:
                    produced[out.request_id] += out.new_token_ids
                    n_new += len(out.new_token_ids)
            if n_new != batch:
                raise RuntimeError(f"a decode step produced {n_new} tokens for a batch of {batch}")
            if i >= warm:
                times.append(dt)
                ctx_sum += sum(prompt_len + len(v) for v in produced.values())
    finally:
        for rid in ids:
            engine.abort(rid)
        engine.step()  # collect the aborted requests' finals
    med = statistics.median(times)
    return {"status": "ok", "prompt_len": prompt_len, "prefill_steps": prefill_steps, "prefill_s": prefill_s,
            "steps_timed": len(times), "ms_per_step": 1e3 * med, "ms_per_step_mean": 1e3 * statistics.fmean(times),
            "ms_per_step_min": 1e3 * min(times), "tok_s": batch / med, "mean_context": ctx_sum / max(1, len(times)) / batch,
            "budget_cut": budget_cut, "first_tokens": [v[:4] for v in produced.values()]}


# --- the runner -----------------------------------------------------------------------------------

def resolve_units(spec: str, smoke: bool, engine_variants: list[str]) -> list[str]:
    units = []
    for part in filter(None, (p.strip() for p in spec.split(","))):
        if part in ("all",):
            units += resolve_units("device,kernels,engine", smoke, engine_variants)
        elif part == "device":
            units.append("device")
        elif part == "kernels":
            units += [f"kernels:{k}" for k in KERNEL_UNITS]
        elif part == "engine":
            units += [f"engine:{v}" for v in engine_variants]
        elif part.removeprefix("kernels:") in KERNEL_UNITS:
            units.append("kernels:" + part.removeprefix("kernels:"))
        elif part.startswith("engine:") and part.removeprefix("engine:") in ENGINE_VARIANTS:
            units.append(part)
        else:
            raise SystemExit(f"unknown section {part!r}: use device, kernels, engine, {', '.join(KERNEL_UNITS)}, "
                             f"or engine:<{'|'.join(ENGINE_VARIANTS)}>")
    seen = set()
    return [u for u in units if not (u in seen or seen.add(u))]


class Runner:
    def __init__(self, ctx: Ctx, args, report: dict):
        self.ctx, self.args, self.report = ctx, args, report
        self.tokens_seen: dict = {}
        self.lock = threading.Lock()

    def add_rows(self, key: str, rows: list[dict]) -> None:
        with self.lock:
            self.report.setdefault(key, []).extend(rows)

    def run_units(self, units: list[str], resume_case: int = 0) -> None:
        for ui, unit in enumerate(units):
            if unit == "device":
                continue  # done up front
            first_case = resume_case if ui == 0 else 0
            lost = self.run_unit(unit, first_case)
            self.write_partial()
            if lost is not None:
                rest = units[ui + 1:]
                if lost[1] is not None:
                    rest = [unit] + rest
                if rest:
                    self.continue_in_child(rest, lost[1] or 0)
                return

    def run_unit(self, unit: str, first_case: int):
        """Run one unit; None, or (unit, next case index or None) when the CUDA context was lost."""
        ctx = self.ctx
        section, name = unit.split(":", 1)
        if section == "kernels":
            try:
                cases = KERNEL_CASES[name](ctx)
            except MissingKernel as e:
                log(f"kernels {name}: missing ({e})")
                self.add_rows("kernels", [{"unit": name, "kernel": name, "case": "-", "status": "missing", "why": str(e)}])
                return None
            except Exception as e:  # noqa: BLE001
                log(f"kernels {name}: import failed: {type(e).__name__}: {e}")
                self.add_rows("kernels", [{"unit": name, "kernel": name, "case": "-", "status": "error",
                                           "why": f"import: {type(e).__name__}: {e}",
                                           "traceback": traceback.format_exc(limit=6)}])
                return None if cuda_healthy(ctx.device) else (unit, None)
            for ci, case in enumerate(cases):
                if ci < first_case:
                    continue
                row = {"unit": name, "kernel": case.kernel, "case": case.label, "dtype": case.dtype}
                t = time.perf_counter()
                try:
                    if self.args.simulate_context_loss == f"{name}#{ci}":
                        raise RuntimeError("simulated loss of the CUDA context")
                    res = case.run()
                    row.update(res)
                    row["status"] = "pass" if res.get("ok") else "FAIL"
                except Exception as e:  # noqa: BLE001
                    row.update(status="error", why=f"{type(e).__name__}: {e}", traceback=traceback.format_exc(limit=8))
                row["wall_s"] = time.perf_counter() - t
                row.pop("ok", None)
                self.add_rows("kernels", [row])
                log(f"  {case.kernel} {case.label}: {row['status']}"
                    + (f" ({row['why']})" if row.get("why") else "")
                    + (f", {row['triton_us']:.1f} us, {row['gbs']:.0f} GB/s" if "triton_us" in row else ""))
                if row["status"] == "error" and (not cuda_healthy(ctx.device)
                                                 or self.args.simulate_context_loss == f"{name}#{ci}"):
                    log("  the CUDA context is lost; the rest continues in a fresh process")
                    return unit, ci + 1 if ci + 1 < len(cases) else None
            return None
        # engine
        if ctx.time_left() < (5 if ctx.smoke else 30):
            self.add_rows("engine", [{"variant": name, "batch": "-", "status": "skipped", "why": "budget"}])
            return None
        a = self.args
        batches = (2,) if ctx.smoke else tuple(a.batches)
        prompt_len = 8 if ctx.smoke else a.prompt_len
        steps, warm = (1, 1) if ctx.smoke else (a.decode_steps, 4)
        try:
            rows = engine_variant(ctx, name, batches, prompt_len, steps, warm, self.tokens_seen)
            self.add_rows("engine", rows)
        except MissingKernel as e:
            self.add_rows("engine", [{"variant": name, "batch": "-", "status": "missing", "why": str(e)}])
        except Exception as e:  # noqa: BLE001
            if isinstance(e, ModuleNotFoundError) and (e.name or "").startswith(ctx.kernel_package):
                log(f"  engine {name}: missing kernel module {e.name}")
                self.add_rows("engine", [{"variant": name, "batch": "-", "status": "missing",
                                          "why": f"kernel module {e.name} does not exist"}])
                return None
            log(f"  engine {name}: {type(e).__name__}: {e}")
            self.add_rows("engine", [{"variant": name, "batch": "-", "status": "error",
                                      "why": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc(limit=10)}])
            if not cuda_healthy(ctx.device):
                return unit, None
        return None

    def continue_in_child(self, units: list[str], resume_case: int) -> None:
        a, ctx = self.args, self.ctx
        left = ctx.time_left()
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "child.json"
            cmd = [sys.executable, str(Path(__file__).resolve()), "--sections", ",".join(units),
                   "--resume-case", str(resume_case), "--json", str(out), "--child",
                   "--budget-s", str(max(left, 1.0)), "--grace-s", str(max(5.0, a.grace_s - 15)),
                   "--seed", str(ctx.seed + 7),
                   "--copy-gbs", str(ctx.copy_gbs or 0), "--read-gbs", str(ctx.read_gbs or 0),
                   "--prompt-len", str(a.prompt_len), "--decode-steps", str(a.decode_steps),
                   "--batches", ",".join(map(str, a.batches)), "--kernel-package", a.kernel_package,
                   "--engine-variants", ",".join(a.engine_variants)]
            if ctx.smoke:
                cmd.append("--smoke")
            log(f"child process for: {', '.join(units)} (from case {resume_case})")
            self.report.setdefault("children", []).append({"units": units, "resume_case": resume_case})
            try:
                subprocess.run(cmd, timeout=max(left, 1.0) + a.grace_s, check=False)
            except subprocess.TimeoutExpired:
                log("child process timed out")
            if out.exists():
                child = json.loads(out.read_text())
                for key in ("kernels", "engine"):
                    self.add_rows(key, child.get(key, []))
                self.report.setdefault("children", []).extend(child.get("children", []))
            else:
                self.add_rows("kernels", [{"unit": units[0], "kernel": units[0], "case": "-", "status": "error",
                                           "why": "the child process wrote no results"}])

    def write_partial(self) -> None:
        with self.lock:
            self.report["elapsed_s"] = self.ctx.elapsed()
            write_json(self.report, self.args.json)


def write_json(report: dict, path: Path) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(report, indent=1, default=str))
        tmp.replace(path)
    except OSError as e:
        log(f"could not write {path}: {e}")


# --- the table ------------------------------------------------------------------------------------

def fmt(v, spec: str, dash: str = "-") -> str:
    """format(v, spec), or a dash of the same width where there is no value."""
    if v is None or (isinstance(v, float) and math.isnan(v)):
        width = "".join(itertools.takewhile(str.isdigit, spec))
        return format(dash, f">{width}") if width else dash
    try:
        return format(v, spec)
    except (TypeError, ValueError):
        return str(v)


def print_table(r: dict) -> None:
    d, bw = r.get("device", {}), r.get("bandwidth", {})
    print()
    print(f"{d.get('name', '?')} (cc {d.get('capability', '-')}, {d.get('sms', '-')} SMs); torch {d.get('torch')}, "
          f"triton {d.get('triton')}, CUDA {d.get('cuda', '-')}" + ("; SMOKE (CPU, Triton interpreter)" if d.get("smoke") else ""))
    if bw:
        print(f"bandwidth: copy {fmt(bw.get('copy_gbs'), '.0f')} GB/s (read+write), read {fmt(bw.get('read_gbs'), '.0f')}, "
              f"write {fmt(bw.get('write_gbs'), '.0f')} GB/s  [{bw.get('bytes', 0) / 2**20:.0f} MiB buffers]")
    rows = r.get("kernels", [])
    if rows:
        print()
        print(f"{'kernel':17} {'case':44} {'dtype':5} {'max abs':>9} {'rel err':>8} {'pass':>7} {'us':>9} "
              f"{'torch us':>9} {'GB/s':>7} {'% copy':>6} {'x torch':>7}  note")
        for k in rows:
            status = k.get("status", "?")
            note = " ".join(filter(None, [k.get("note"), k.get("why") if status != "pass" else None, k.get("timing")]))
            print(f"{k.get('kernel', ''):17.17} {k.get('case', ''):44.44} {k.get('dtype', ''):5} "
                  f"{fmt(k.get('max_abs'), '9.2e')} {fmt(k.get('max_rel'), '8.1e')} {status:>7} "
                  f"{fmt(k.get('triton_us'), '9.1f')} {fmt(k.get('torch_us'), '9.1f')} {fmt(k.get('gbs'), '7.0f')} "
                  f"{fmt(100 * k['frac_copy'] if 'frac_copy' in k else None, '5.0f')}{'%' if 'frac_copy' in k else ' '} {fmt(k.get('speedup'), '7.2f')}  "
                  f"{note}"[:260])
        n = {s: sum(1 for k in rows if k.get("status") == s) for s in ("pass", "FAIL", "error", "missing")}
        print(f"kernel cases: {n['pass']} pass, {n['FAIL']} FAIL, {n['error']} error, {n['missing']} missing")
        mb = [k for k in rows if "frac_copy" in k and k.get("memory_bound", True)]
        if mb:
            low = [f"{k['kernel']} [{k['case'][:28].strip()}] {100 * k['frac_copy']:.0f}%" for k in mb if k["frac_copy"] < 0.7]
            print(f"memory-bound cases at >= 70% of the copy bandwidth: {len(mb) - len(low)}/{len(mb)}"
                  + (f"; below: {', '.join(low)}" if low else ""))
    eng = r.get("engine", [])
    if eng:
        print()
        print("engine decode (Llama-3-8B-shaped, random bf16 weights" + (", tiny model in smoke mode" if d.get("smoke") else "")
              + "); bound = (weights read + KV read) / copy bandwidth")
        print(f"{'variant':9} {'batch':>5} {'ms/step':>8} {'tok/s':>8} {'bound ms':>8} {'x bound':>7} {'w-only ms':>9} "
              f"{'x w-only':>8} {'prefill s':>9} {'weights GiB':>11}  note")
        for e in eng:
            if e.get("status") not in ("ok", None):
                print(f"{e.get('variant', ''):9} {str(e.get('batch', '')):>5} {e.get('status')}: {e.get('why', '')}"[:400])
                continue
            print(f"{e['variant']:9} {e['batch']:>5} {fmt(e.get('ms_per_step'), '8.2f')} {fmt(e.get('tok_s'), '8.1f')} "
                  f"{fmt(e.get('bound_ms'), '8.2f')} {fmt(e.get('x_bound'), '7.2f')} {fmt(e.get('bound_w_ms'), '9.2f')} "
                  f"{fmt(e.get('x_bound_w'), '8.2f')} {fmt(e.get('prefill_s'), '9.2f')} "
                  f"{fmt(e.get('weight_bytes', 0) / 2**30, '11.2f')}  {e.get('note', '')}"
                  + (" (budget cut)" if e.get("budget_cut") else ""))
    print(f"targets: memory-bound kernels >= 70% of copy bandwidth; batch-1 decode <= 1.3x the bound. "
          f"elapsed {fmt(r.get('elapsed_s'), '.0f')} s")


# --- main -----------------------------------------------------------------------------------------

def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="CPU, tiny shapes, Triton interpreter (implied without CUDA)")
    p.add_argument("--sections", default="device,kernels,engine",
                   help="comma list: device, kernels, engine, a kernel unit (" + ", ".join(KERNEL_UNITS)
                   + ") or engine:<variant>; the device facts and bandwidth are always measured")
    p.add_argument("--engine-variants", type=lambda s: [v for v in s.split(",") if v], default=None,
                   help=f"engine variants for 'engine', in order (default {','.join(DEFAULT_ENGINE_VARIANTS)}; "
                   f"known: {','.join(ENGINE_VARIANTS)})")
    p.add_argument("--budget-s", type=float, default=240.0, help="soft time budget: timing stops past it")
    p.add_argument("--grace-s", type=float, default=40.0, help="the watchdog ends the run this long after the budget")
    p.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")], default=[1, 64],
                   help="engine decode batch sizes (default 1,64)")
    p.add_argument("--prompt-len", type=int, default=128, help="engine prompt tokens per request")
    p.add_argument("--decode-steps", type=int, default=64, help="timed engine decode steps per batch size")
    p.add_argument("--seed", type=int, default=None, help="default: a fresh one (recorded in the JSON)")
    p.add_argument("--json", type=Path, default=None,
                   help=f"results file (default {RESULTS.relative_to(ROOT)}, or {SMOKE_RESULTS.name} beside it in smoke mode)")
    p.add_argument("--table-from", type=Path, metavar="JSON", help="print the table of an earlier run and exit")
    p.add_argument("--copy-gbs", type=float, default=0.0, help=argparse.SUPPRESS)  # child processes
    p.add_argument("--read-gbs", type=float, default=0.0, help=argparse.SUPPRESS)
    p.add_argument("--resume-case", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--kernel-package", default="sluice.engine.kernels", help=argparse.SUPPRESS)
    # test hook: behave as if case CASE of kernel unit UNIT ("UNIT#CASE") killed the CUDA context
    p.add_argument("--simulate-context-loss", default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.table_from:
        print_table(json.loads(a.table_from.read_text()))
        return 0

    smoke = a.smoke or not torch.cuda.is_available()
    a.json = a.json or (SMOKE_RESULTS if smoke else RESULTS)
    if smoke and not a.smoke:
        log("no CUDA device: running the smoke mode (CPU, tiny shapes, Triton interpreter)")
    a.engine_variants = a.engine_variants or list(SMOKE_ENGINE_VARIANTS if smoke else DEFAULT_ENGINE_VARIANTS)
    unknown = [v for v in a.engine_variants if v not in ENGINE_VARIANTS]
    if unknown:
        raise SystemExit(f"unknown engine variant(s) {unknown}; known: {list(ENGINE_VARIANTS)}")
    units = resolve_units(a.sections, smoke, a.engine_variants)
    seed = a.seed if a.seed is not None else int.from_bytes(os.urandom(3), "little")
    n_engine = sum(u.startswith("engine:") for u in units)
    ctx = Ctx(smoke=smoke, device=torch.device("cpu" if smoke else "cuda"), dtype=torch.bfloat16, seed=seed,
              started=time.perf_counter(), budget_s=a.budget_s,
              engine_reserve_s=min(0.5 * a.budget_s, (8 if smoke else 25) * n_engine), kernel_package=a.kernel_package)
    if smoke:
        torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    report: dict = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
                    "command": " ".join(["bench/gpu.py", *sys.argv[1:]]), "seed": seed, "units": units,
                    "budget_s": a.budget_s}
    runner = Runner(ctx, a, report)

    def finish(code: int) -> None:
        report["elapsed_s"] = ctx.elapsed()
        write_json(report, a.json)
        if not a.child:
            try:
                print_table(report)
            except Exception as e:  # noqa: BLE001  (the numbers are in the JSON anyway)
                log(f"could not print the table: {type(e).__name__}: {e}")
                print(json.dumps({k: report.get(k) for k in ("kernels", "engine")}, indent=1, default=str))
            log(f"wrote {a.json}")
        sys.stdout.flush()
        sys.stderr.flush()

    def watchdog():
        deadline = a.budget_s + a.grace_s
        while ctx.elapsed() < deadline:
            time.sleep(1.0)
        log(f"watchdog: {deadline:.0f} s passed; ending with what was measured")
        with runner.lock:
            report["watchdog"] = f"ended after {ctx.elapsed():.0f} s"
            finish(3)
        os._exit(3)

    threading.Thread(target=watchdog, daemon=True).start()

    def on_term(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, on_term)
    code = 0
    try:
        try:
            report["device"] = device_facts(ctx)
        except Exception as e:  # noqa: BLE001
            report["device"] = {"name": "?", "error": f"{type(e).__name__}: {e}", "smoke": smoke}
        log(f"device: {report['device'].get('name')} torch {torch.__version__} triton {report['device'].get('triton')}"
            f" seed {seed}")
        if a.copy_gbs:
            ctx.copy_gbs, ctx.read_gbs = a.copy_gbs, a.read_gbs or None
            report["bandwidth"] = {"copy_gbs": a.copy_gbs, "read_gbs": a.read_gbs, "from_parent": True}
        else:
            try:
                bw = bandwidth(ctx)
                report["bandwidth"] = bw
                ctx.copy_gbs, ctx.read_gbs = bw["copy_gbs"], bw["read_gbs"]
                log(f"bandwidth: copy {bw['copy_gbs']:.0f} GB/s, read {bw['read_gbs']:.0f}, write {bw['write_gbs']:.0f}")
            except Exception as e:  # noqa: BLE001
                report["bandwidth"] = {"error": f"{type(e).__name__}: {e}"}
                log(f"bandwidth failed: {e}")
        runner.run_units(units, a.resume_case)
    except KeyboardInterrupt as e:
        report["interrupted"] = str(e) or "KeyboardInterrupt"
        code = 130
    except Exception as e:  # noqa: BLE001  (the run must end with a table)
        report["error"] = f"{type(e).__name__}: {e}"
        report["traceback"] = traceback.format_exc()
        log(report["traceback"])
        code = 1
    with runner.lock:
        finish(code)
    return code


if __name__ == "__main__":
    sys.exit(main())
