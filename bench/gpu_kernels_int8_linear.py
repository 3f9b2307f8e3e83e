"""Kernel cases of bench/gpu.py for int8 weight-only linear layers (int8_linear): the quantizer,
the matmul against its torch reference and float64, and timing beside a dense bf16 matmul."""

from __future__ import annotations

import torch

from bench.gpu_common import Ctx
from bench.gpu_kernel_harness import (
    TOL,
    Case,
    compare,
    dtype_name,
    esize,
    load_ops,
    merge_cmp,
    randn,
    rel_err,
    takes_kw,
    timing,
)


def cases_int8_linear(ctx: Ctx) -> list[Case]:
    m = load_ops(ctx, "int8_linear", "quantize_int8", "int8_linear_torch", "int8_linear_triton")
    if ctx.smoke:
        layers = {"a": (48, 64), "b": (40, 100)}
        plan = [("a", 1, True), ("b", 33, False)]
    else:
        layers = {
            "qkv": (6144, 4096),
            "o": (4096, 4096),
            "gate_up": (28672, 4096),
            "down": (4096, 14336),
        }
        plan = (
            [(n, 1, False) for n in layers]
            + [(n, 64, False) for n in layers]
            + [("gate_up", 2048, False), ("down", 2048, False), ("qkv", 64, True)]
        )
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
        qerr = float(
            ((q.double() * s.double()[:, None] - w.double()).abs() / s.double()[:, None]).max()
        )
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
        # 2 M FLOP per weight byte: compute-bound from a few hundred rows
        row["memory_bound"] = M < 256
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
        nbytes = (
            M * K * esize(dt)
            + N * K
            + N * 4
            + M * N * esize(dt)
            + (N * esize(dt) if with_bias else 0)
        )
        dense = torch.nn.functional.linear
        row.update(
            timing(
                ctx,
                lambda: m.int8_linear_triton(x, q, s, bias),
                lambda: m.int8_linear_torch(x, q, s, bias),
                nbytes,
                flops=2.0 * M * N * K,
                extra={"dense_bf16": lambda: dense(x, w, bias)},
            )
        )
        if "dense_bf16_us" in row:
            row["note"] = (
                f"x{row['dense_bf16_us'] / row['triton_us']:.2f} vs dense {dtype_name(dt)}"
            )
            if M >= 256:
                row["note"] += f", {row['tflops']:.0f} TFLOP/s"
        return row

    return [
        Case(
            "int8_linear",
            f"{name} M={M} N={layers[name][0]} K={layers[name][1]}" + (" +bias" if b else ""),
            dtype_name(dt),
            lambda a=(name, M, b): run(*a),
        )
        for name, M, b in plan
    ]
