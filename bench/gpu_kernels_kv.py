"""Kernel cases of bench/gpu.py for the paged KV cache: write_kv (kv_cache) and paged decode
attention (paged_attention), with model-dtype, int8 and fp8 caches."""

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

# KV cache ----------------------------------------------------------------------------------------


def make_cache(ctx: Ctx, g, shape, kind: str, fill_scale: float = 1.0):
    """A [num_blocks, Hkv, bs, D] cache of random content ("bf16"/model dtype, "int8", "fp8") and
    its per-(block, head) float32 scales (None for the model dtype)."""
    nb, hkv = shape[0], shape[1]
    if kind == "int8":
        c = torch.randint(-127, 128, shape, generator=g, device=ctx.device, dtype=torch.int8)
        s = (0.5 + torch.rand(nb, hkv, generator=g, device=ctx.device)) * fill_scale / 127
        return c, s
    if kind == "fp8":
        c = (
            (torch.randn(shape, generator=g, device=ctx.device) * 64)
            .clamp(-448, 448)
            .to(torch.float8_e4m3fn)
        )
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
        allowed = 0.126 * torch.maximum(x.abs(), y.abs()).nan_to_num(0.0) + 2.0**-9 * smax
    worst = float((diff / allowed.clamp(min=1e-30)).max())
    scale = float(y[fin].abs().max()) if bool(fin.any()) else 0.0
    max_abs = float(diff.max())
    res = {
        "max_abs": max_abs,
        "max_rel": max_abs / scale if scale else max_abs,
        "ok": bad == 0 and worst <= 1.0,
        "err_over_tol": worst,
        "exact_fraction": float((a.view(torch.uint8) == b.view(torch.uint8)).double().mean()),
    }
    if bad:
        res["why"] = f"{bad} non-finite where the reference is finite"
    elif worst > 1.0:
        res["why"] = (
            f"differs by {worst:.2g}x one quantization step somewhere (max abs {max_abs:.3g})"
        )
    return res


def slot_mapping_for(
    ctx: Ctx, g, seqs: list[tuple[int, int]], num_blocks: int, bs: int
) -> torch.Tensor:
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
        steps = [
            ("decode N=64", None, 64, 1),
            ("prefill T=2048", [(0, 512), (37, 512), (0, 512), (500, 512)], 0, 0),
        ]
    dt = ctx.dtype

    def run(seqs: list[tuple[int, int]] | None, n_dec: int, kind: str) -> dict:
        g = ctx.gen()
        if seqs is None:  # decodes: one new token each, after 0..300 cached ones
            seqs = [
                (int(c), 1) for c in torch.randint(0, 300, (n_dec,), generator=g, device=ctx.device)
            ]
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
                # fp8 tensors have no fill: zero their bytes
                (c.view(torch.uint8) if c.dtype == torch.float8_e4m3fn else c)[fresh] = 0
                s[fresh] = 0.0

        def state():
            return (
                kc0.clone(),
                vc0.clone(),
                None if ks0 is None else ks0.clone(),
                None if vs0 is None else vs0.clone(),
            )

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
                parts[name] = {
                    "max_abs": diff,
                    "max_rel": diff,
                    "ok": same_nan and diff == 0.0,
                    **(
                        {}
                        if same_nan
                        else {"why": "NaN pattern differs (a slot unwritten or written elsewhere)"}
                    ),
                }
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
            # (e4m3 round to nearest; 2^-10 of the scale absolute among subnormals), of what was
            # written
            wk_t, wk_r = written(kt, kst), written(kr, ksr)
            err_t, err_r = (wk_t - k.double()).abs(), (wk_r - k.double()).abs()
            if kind == "int8":
                step = ksr[blk].double()[..., None]
                f64 = {
                    "torch_steps": float((err_r / step).max()),
                    "triton_steps": float((err_t / (kst[blk].double()[..., None])).max()),
                }
                ref_ok = f64["torch_steps"] <= 0.5 + 1e-3
            else:
                scale_r = ksr[blk].double()[..., None]
                # e4m3's smallest normal: below it, half a 2^-9 step absolute
                small = 2.0**-6 * scale_r
                f64 = {
                    "torch_rel": float((err_r / (k.double().abs() + small)).max()),
                    "triton_rel": float((err_t / (k.double().abs() + small)).max()),
                }
                ref_ok = f64["torch_rel"] <= 0.0625 + 1e-3
            row["vs_f64"] = f64
            # blocks continued part-way (first offset written > 0) whose K scale grew: requantized
            first = torch.full((nb,), bs, dtype=torch.int64, device=ctx.device).scatter_reduce(
                0, blk, off, "amin"
            )
            cont = (first > 0) & (first < bs)
            grew = int(((ksr > ks0) & cont[:, None]).sum())
            row["note"] = f"{grew} of {int(cont.sum()) * hkv} continued (block, head) K scales grew"
            if not ref_ok:
                row.update(
                    ok=False, why=f"torch reference: written values off what was written ({f64})"
                )
        kc, vc, ksc, vsc = state()
        kc2, vc2, ksc2, vsc2 = state()
        elt_c = esize(kc0.dtype)
        # bytes: read k and v, write them into the cache, read the slot mapping (int64); a
        # quantized cache also reads/writes one scale per (token, head) (upper bound: requantized
        # old entries of a block whose scale grew are not counted)
        nbytes = (
            2 * T * hkv * d * (esize(dt) + elt_c)
            + T * 8
            + (0 if kind == "bf16" else 2 * 2 * T * hkv * 4)
        )
        row.update(
            timing(
                ctx,
                lambda: m.write_kv_triton(k, v, kc, vc, slots, ksc, vsc),
                lambda: m.write_kv_torch(k, v, kc2, vc2, slots, ksc2, vsc2),
                nbytes,
            )
        )
        return row

    return [
        Case(
            "write_kv",
            f"{label} Hkv={hkv} D={d} bs={bs} cache {kind}",
            dtype_name(dt),
            lambda a=(seqs, n, kind): run(*a),
        )
        for kind in kinds
        for label, seqs, n, _ in steps
    ]


# paged decode attention ---------------------------------------------------------------------------


def cases_paged_attention(ctx: Ctx) -> list[Case]:
    m = load_ops(
        ctx, "paged_attention", "paged_decode_attention_torch", "paged_decode_attention_triton"
    )
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
        scale = d**-0.5
        args = (q, kc, vc, tables, seq_lens, scale, ks, vs, window)
        # the engine knows the longest context on the host: passing it spares the wrapper a sync
        kw = (
            {"max_seq_len": int(lens.max())}
            if takes_kw(m.paged_decode_attention_triton, "max_seq_len")
            else {}
        )
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

            def ctx_of(c, s, blocks=blocks, L=L):
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
            errs.append(
                (
                    float((out[i].double() - t).abs().max()) / scale_i,
                    float((ref[i].double() - t).abs().max()) / scale_i,
                )
            )
        f64 = {
            "triton": max(e[0] for e in errs),
            "torch": max(e[1] for e in errs),
            "seqs_checked": len(errs),
        }
        row["vs_f64"] = f64
        if f64["torch"] > tol:
            row.update(ok=False, why=f"torch reference off float64 by {f64['torch']:.3g}")
        attended = lens.clamp(max=window) if window else lens
        # bytes: read q, write out, read the attended K and V (whole blocks), the block tables and
        # seq_lens, and for a quantized cache one K and one V scale per (block, KV head) read
        blocks_read = int(((attended + bs - 1) // bs).sum()) + (N if window else 0)
        nbytes = (
            2 * N * hq * d * esize(dt)
            + 2 * blocks_read * hkv * bs * d * esize(kc.dtype)
            + N * maxb * 4
            + N * 4
            + (0 if ks is None else 2 * blocks_read * hkv * 4)
        )
        row.update(
            timing(
                ctx,
                lambda: m.paged_decode_attention_triton(*args, **kw),
                lambda: m.paged_decode_attention_torch(*args),
                nbytes,
            )
        )
        row["note"] = f"ctx {int(lens.min())}-{int(lens.max())}" + (
            f" win {window}" if window else ""
        )
        return row

    cases = [
        Case(
            "paged_decode_attn",
            f"N={N} Hq={hq} Hkv={hkv} D={d} L={lo}-{hi} kv {kind}",
            dtype_name(dt),
            lambda a=(N, lo, hi, w, kind): run(*a),
        )
        for kind in kinds
        for N, lo, hi, w in shapes
    ]
    cases += [
        Case(
            "paged_decode_attn",
            f"N={N} L={lo}-{hi}" + (f" win={w}" if w else "") + f" kv {kind}",
            dtype_name(dt),
            lambda a=(N, lo, hi, w, kind): run(*a),
        )
        for N, lo, hi, w, kind in extra
    ]
    return cases
