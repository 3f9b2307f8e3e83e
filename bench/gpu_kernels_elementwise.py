"""Kernel cases of bench/gpu.py for the elementwise kernels: add_rmsnorm (norm), silu_and_mul
(activation) and rotary_ (rotary), each against its torch reference and float64."""

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
    qkv_views,
    randn,
    rel_err,
    takes_kw,
    timing,
)

# norm ------------------------------------------------------------------------------------------


def cases_norm(ctx: Ctx) -> list[Case]:
    m = load_ops(ctx, "norm", "add_rmsnorm_torch", "add_rmsnorm_triton")
    shapes = (
        [(4, 96, True), (3, 64, False)]
        if ctx.smoke
        else [(2048, 4096, True), (64, 4096, True), (2048, 4096, False)]
    )
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
        parts = {
            "normed": compare(out[0], ref[0], TOL[dt]),
            "residual": compare(out[1], ref[1], TOL[dt]),
        }
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
        row.update(
            timing(
                ctx,
                lambda: m.add_rmsnorm_triton(xt, rt, w, eps),
                lambda: m.add_rmsnorm_torch(xt, rt, w, eps),
                nbytes,
            )
        )
        return row

    return [
        Case(
            "add_rmsnorm",
            f"T={T} H={H}" + (" +res" if r else " no res"),
            dtype_name(dt),
            lambda T=T, H=H, r=r: run(T, H, r),
        )
        for T, H, r in shapes
    ]


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
        row.update(
            timing(ctx, lambda: m.silu_and_mul_triton(x), lambda: m.silu_and_mul_torch(x), nbytes)
        )
        return row

    return [
        Case(
            "silu_and_mul",
            f"T={T} I={inter}",
            dtype_name(dt),
            lambda T=T, inter=inter: run(T, inter),
        )
        for T, inter in shapes
    ]


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

        errs = {
            name: max(rel_err(qr, truth(q, il)), rel_err(kr, truth(k, il)))
            for name, il in (("rotate_half", False), ("interleaved", True))
        }
        conv = min(errs, key=errs.get)
        f64 = {
            "convention": conv,
            "torch": errs[conv],
            "triton": max(
                rel_err(qt, truth(q, conv == "interleaved")),
                rel_err(kt, truth(k, conv == "interleaved")),
            ),
        }
        row["vs_f64"] = f64
        if errs[conv] > TOL[dt]:
            row.update(
                ok=False, why=f"torch reference matches neither convention in float64 ({errs})"
            )
        c2, s2 = angles(g, T, D)
        qa, ka, _ = qkv_views(qkv.clone(), Hq, Hkv, D)
        qb, kb, _ = qkv_views(qkv.clone(), Hq, Hkv, D)
        # bytes: read + write q and k in place, read cos and sin (float32)
        nbytes = 2 * T * (Hq + Hkv) * D * esize(dt) + 2 * T * (D // 2) * 4
        row.update(
            timing(
                ctx,
                lambda: m.rotary_triton_(qa, ka, c2, s2),
                lambda: m.rotary_torch_(qb, kb, c2, s2),
                nbytes,
            )
        )
        return row

    return [
        Case(
            "rotary_",
            f"T={T} Hq={Hq} Hkv={Hkv} D={D}",
            dtype_name(dt),
            lambda a=(T, Hq, Hkv, D): run(*a),
        )
        for T, Hq, Hkv, D in shapes
    ]
