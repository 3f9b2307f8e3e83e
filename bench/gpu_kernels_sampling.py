"""Kernel cases of bench/gpu.py for the sampler (sampling): the tokens drawn must lie in each
row's allowed set, repeat for the same seeds, and follow the distribution."""

from __future__ import annotations

import math

import torch

from bench.gpu_common import Ctx
from bench.gpu_kernel_harness import Case, load_ops, timing


def sampling_params(ctx: Ctx, g, N: int, V: int):
    """Mixed rows: greedy, plain, top-k, top-p, min-p, all three (0 / 1.0 / 0.0 switch a filter
    off)."""
    kinds = [
        (0.0, 0, 1.0, 0.0),
        (1.0, 0, 1.0, 0.0),
        (0.8, 50, 1.0, 0.0),
        (1.0, 0, 0.9, 0.0),
        (1.0, 0, 1.0, 0.05),
        (0.7, 100, 0.95, 0.02),
    ]
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
        row = {
            "ok": not why,
            "max_abs": None,
            "max_rel": None,
            "agree_with_torch": agree,
            "note": f"same token as torch {agree:.0%} (not required)",
        }
        if why:
            row["why"] = "; ".join(why)
        # bytes: read the logits once and the per-row parameters, write one int64 per row
        nbytes = N * V * 4 + N * (4 * 4 + 8) + N * 8
        row.update(
            timing(ctx, lambda: m.sample_triton(*args), lambda: m.sample_torch(*args), nbytes)
        )
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
            outside[name] = int(((tok < 0) | (tok >= V)).sum()) + int(
                torch.bincount(tok.clamp(0, V - 1), minlength=V)[p == 0].sum()
            )
        # expected TV of an exact sampler ~ 0.5 * sum sqrt(2 p (1-p) / (pi N)); allow 3x that
        expect = 0.5 * float(torch.sqrt(2 * p * (1 - p) / (math.pi * N)).sum())
        limit = 3 * expect + 0.01
        res.update(
            ok=tv["triton"] <= limit and tv["torch"] <= limit and not any(outside.values()),
            max_abs=None,
            max_rel=None,
            tv=tv,
            tv_limit=limit,
            outside_support=outside,
            note=f"TV triton {tv['triton']:.3f} torch {tv['torch']:.3f} (limit {limit:.3f})",
        )
        if any(outside.values()):
            res["why"] = f"draws outside the kept tokens: {outside}"
        elif not res["ok"]:
            res["why"] = f"empirical distribution off: TV {tv} > {limit:.3f}"
        return res

    cases = [
        Case("sample", f"N={N} V={V} mixed params", "fp32", lambda N=N, V=V: run(N, V))
        for N, V in shapes
    ]
    # The interpreter runs a program per row: the smoke run keeps this check small (weak
    # statistics).
    nd, vd = (48, 32) if ctx.smoke else (16384, 1000)
    cases.append(
        Case(
            "sample",
            f"distribution N={nd} V={vd} T=0.7 top_k=8",
            "fp32",
            lambda: run_distribution(nd, vd, 8, 0.7),
        )
    )
    if not ctx.smoke:
        cases.append(
            Case(
                "sample",
                f"distribution N={nd} V={vd} T=1",
                "fp32",
                lambda: run_distribution(nd, vd, 0, 1.0),
            )
        )
    return cases
