"""Paged decode attention: the Triton kernel (interpreted on the CPU) against the torch reference,
and the reference against a float64 loop that reads the cache one token position at a time.

Caches are built so that a careless read shows: blocks are scattered with unused blocks between
them, every slot no query may attend (unused blocks, the tail of a sequence's last block, blocks
wholly before a sliding window) holds NaN (quantized: 127 or NaN with a NaN scale), block-table
padding and out-of-window entries name such blocks (or, in some tests, ids that are negative or
far past the cache), and the output (and merge scratch) the kernel writes into starts as NaN.
"""

from __future__ import annotations

import pytest
import torch

from sluice.engine.kernels.paged_attention import (
    paged_decode_attention_torch,
    paged_decode_attention_triton,
)

# (rtol, atol) for one computation against another in the output's dtype: two float32 results
# rounded to bfloat16 may land one unit in the last place apart.
TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (2e-3, 2e-3), torch.bfloat16: (1.6e-2, 1.6e-2)}


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _quantize(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 [nb, Hkv, bs, D] -> (stored, scale [nb, Hkv]) with scale = absmax / largest code."""
    top = 127.0 if dtype == torch.int8 else 448.0
    scale = x.abs().amax(dim=(2, 3)).clamp(min=1e-6) / top
    y = x / scale[..., None, None]
    stored = y.round().clamp(-127, 127).to(torch.int8) if dtype == torch.int8 else y.to(dtype)
    return stored, scale


def build_case(
    lens, hkv, group, d, bs, dtype, *, quant=None, window=None, share=0, seed=0, wild=False
):
    """Random decode batch over a scattered, poisoned cache. Returns (args for the kernels,
    float64 caches as the kernel should read them, float64 caches before quantization).

    Table entries that must not be read (padding, blocks wholly before the window) name unused,
    poisoned blocks, so reading one spoils the result; with `wild` they are negative or far past
    the cache instead, which only a kernel that never dereferences them survives (one that does
    crashes the interpreter or, on a GPU, faults)."""
    gen = torch.Generator().manual_seed(seed)
    n = len(lens)
    nblk = [_cdiv(length, bs) for length in lens]
    num_blocks = 2 * sum(nblk) + 5
    width = max(nblk + [1]) + 2
    perm = torch.randperm(num_blocks, generator=gen)
    spare = perm[sum(nblk) :]

    def junk_ids(*shape):
        if wild:
            return torch.randint(-4, 1 << 30, shape, generator=gen)
        return spare[torch.randint(0, len(spare), shape, generator=gen)]

    table = junk_ids(n, width)  # padding
    used = 0
    for i, nb in enumerate(nblk):
        table[i, :nb] = perm[used : used + nb]
        used += nb
    if share:  # the last sequence shares its first `share` (full) blocks with the one before it
        assert share * bs <= min(lens[-2], lens[-1])
        table[-1, :share] = table[-2, :share]
    firsts = [max(0, length - window) if window else 0 for length in lens]
    if window:  # blocks wholly before the window may be freed: their entries become garbage
        for i, first in enumerate(firsts):
            table[i, : first // bs] = junk_ids(first // bs)
    attended = torch.zeros(num_blocks, bs, dtype=torch.bool)
    for i, (first, length) in enumerate(zip(firsts, lens)):
        pos = torch.arange(first, length)
        attended[table[i, pos // bs], pos % bs] = True
    referenced = attended.any(-1)
    slot_mask = ~attended[:, None, :, None]

    k = torch.randn(num_blocks, hkv, bs, d, generator=gen)
    v = torch.randn(num_blocks, hkv, bs, d, generator=gen)
    q = (2.0 * torch.randn(n, hkv * group, d, generator=gen)).to(dtype)
    raw = (k.double(), v.double())
    if quant is None:
        k_cache = k.to(dtype).masked_fill(slot_mask, float("nan"))
        v_cache = v.to(dtype).masked_fill(slot_mask, float("nan"))
        scales = (None, None)
        seen = (k_cache.double(), v_cache.double())
    else:
        (k_cache, ks), (v_cache, vs) = _quantize(k, quant), _quantize(v, quant)
        seen = (
            k_cache.double() * ks.double()[..., None, None],
            v_cache.double() * vs.double()[..., None, None],
        )
        junk = torch.tensor(127 if quant == torch.int8 else float("nan")).to(quant)
        k_cache = torch.where(slot_mask, junk, k_cache)
        v_cache = torch.where(slot_mask, junk, v_cache)
        ks = ks.masked_fill(~referenced[:, None], float("nan"))
        vs = vs.masked_fill(~referenced[:, None], float("nan"))
        scales = (ks, vs)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    args = (q, k_cache, v_cache, table.to(torch.int32), seq_lens, d**-0.5, *scales, window)
    return args, seen, raw


def attention_f64(q, k64, v64, table, lens, scale, window):
    """Float64 decode attention, one sequence and one attended position at a time."""
    n, hq, d = q.shape
    _, hkv, bs, _ = k64.shape
    out = torch.zeros(n, hq, d, dtype=torch.float64)
    for i in range(n):
        length = int(lens[i])
        first = max(0, length - window) if window else 0
        if length == 0:
            continue
        pos = torch.arange(first, length)
        blocks, slots = table[i, pos // bs].long(), pos % bs
        k = k64[blocks, :, slots].repeat_interleave(hq // hkv, dim=1)  # [len, Hq, D]
        v = v64[blocks, :, slots].repeat_interleave(hq // hkv, dim=1)
        p = torch.softmax(torch.einsum("hd,lhd->hl", q[i].double(), k) * scale, dim=-1)
        out[i] = torch.einsum("hl,lhd->hd", p, v)
    return out


def run_triton(args, **kw):
    """The kernel writing into a NaN-filled output (and NaN-filled merge scratch when split)."""
    q = args[0]
    out = torch.full_like(q, float("nan"))
    splits = kw.get("num_splits")
    if splits and splits > 1:
        n, hq, d = q.shape
        kw["workspace"] = (
            torch.full((n, hq, splits, d), float("nan")),
            torch.full((n, hq, splits), float("nan")),
        )
    res = paged_decode_attention_triton(*args, out=out, **kw)
    assert res.data_ptr() == out.data_ptr() and res.dtype == q.dtype
    assert torch.isfinite(res).all(), "an output element was not written (or NaN leaked in)"
    return res


def check(args, seen, tol_dtype=None, **kw):
    """Reference vs float64, then kernel vs reference; returns the kernel's result."""
    q, _, _, table, lens, scale, _, _, window = args
    rtol, atol = TOL[tol_dtype or q.dtype]
    ref = paged_decode_attention_torch(*args)
    assert ref.dtype == q.dtype and torch.isfinite(ref).all()
    f64 = attention_f64(q, *seen, table, lens, scale, window)
    torch.testing.assert_close(ref.double(), f64, rtol=rtol, atol=atol)
    got = run_triton(args, **kw)
    torch.testing.assert_close(got.float(), ref.float(), rtol=rtol, atol=atol)
    return got


# Context lengths: 1 token, shorter than a block, exactly a block, many blocks (block size 16).
LENS = [1, 5, 16, 300]


# (query dtype, KV heads, group size G, head dim): G in {1, 3, 8}, each dtype at least once
# (float32 with G = 3 also in the sliding-window and int8 tests).
FLOAT_CASES = [
    (torch.float32, 2, 1, 64),
    (torch.bfloat16, 2, 3, 64),
    (torch.float16, 2, 8, 128),
    (torch.bfloat16, 2, 8, 128),
]


@pytest.mark.parametrize(
    "dtype,hkv,group,d", FLOAT_CASES, ids=lambda v: str(v).replace("torch.", "")
)
def test_float_cache_matches_reference(dtype, hkv, group, d):
    args, seen, _ = build_case(LENS, hkv, group, d, 16, dtype, share=1, seed=group)
    one = check(
        args, seen
    )  # default: one partition on the CPU, the kernel writes the output itself
    # Uneven partitions: 300 tokens in 3 x 128 (the last one 44), the short sequences' later
    # partitions empty.
    split = check(args, seen, num_splits=3)
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(split.float(), one.float(), rtol=rtol, atol=atol)
    if group != 8:  # without a preallocated output
        torch.testing.assert_close(
            paged_decode_attention_triton(*args, num_splits=2), one, rtol=rtol, atol=atol
        )


@pytest.mark.parametrize(
    "quant,dtype,hkv,group,window",
    [
        (torch.int8, torch.float32, 3, 3, None),
        (torch.int8, torch.bfloat16, 2, 8, 37),
        (torch.float8_e4m3fn, torch.float16, 2, 1, None),
        (torch.float8_e4m3fn, torch.bfloat16, 2, 3, 37),
    ],
    ids=["int8-f32-G3", "int8-bf16-G8-window", "fp8-f16-G1", "fp8-bf16-G3-window"],
)
def test_quantized_cache(quant, dtype, hkv, group, window):
    args, seen, raw = build_case(
        LENS, hkv, group, 64, 16, dtype, quant=quant, window=window, share=1, seed=7
    )
    # Same quantized cache: kernel and reference agree tightly, and the reference matches float64
    # on the dequantized values (`check`).
    got = check(args, seen, num_splits=2)
    # Against the unquantized cache, only as close as the quantization allows (int8 steps of
    # absmax/254, fp8 e4m3 ~6% per value); a wrong or missing scale is off by far more.
    q, _, _, table, lens, scale, _, _, window = args
    exact = attention_f64(q, *raw, table, lens, scale, window)
    err = (got.double() - exact).abs().max().item()
    bound = 0.05 if quant == torch.int8 else 0.25
    assert err < bound, f"{quant} cache off the unquantized result by {err}"
    assert err > 1e-6  # the cache really was quantized


def test_sliding_window():
    lens = [1, 5, 16, 40, 300]
    args, seen, _ = build_case(lens, 2, 3, 64, 16, torch.float32, window=37, seed=3, wild=True)
    check(args, seen)
    check(args, seen, num_splits=3)
    # A window of 1 returns the newest V.
    newest = check(args[:-1] + (1,), seen)
    for i, length in enumerate(lens):
        block = args[3][i, (length - 1) // 16]
        want = seen[1][block, :, (length - 1) % 16].repeat_interleave(3, dim=0)
        torch.testing.assert_close(newest[i].double(), want, rtol=1e-6, atol=1e-6)
    # A window covering every context changes nothing (on a table with all its entries intact).
    args, seen, _ = build_case(lens, 2, 3, 64, 16, torch.float32, seed=4)
    torch.testing.assert_close(
        run_triton(args[:-1] + (300,), num_splits=2),
        paged_decode_attention_torch(*args),
        rtol=1e-5,
        atol=1e-5,
    )


def test_many_uneven_splits_small_tiles():
    """Tiles smaller than a block (block 32, tile 16), 7 partitions: most partitions of the short
    sequences are empty, the long one's last partition is partial."""
    args, seen, _ = build_case([1, 33, 200], 1, 3, 64, 32, torch.float16, share=1, seed=11)
    check(args, seen, num_splits=7, block_n=16)
    check(args, seen, num_splits=1, block_n=16)


def test_shared_prefix_and_strided_query():
    """Two sequences on the same prefix blocks (and the same queries) agree on a prefix-only
    context; q is a view with a row stride larger than Hq * D, as split from a fused projection."""
    args, seen, _ = build_case([48, 100], 2, 3, 64, 16, torch.float32, share=3, seed=5)
    q, kc, vc, table, lens, scale, ks, vs, window = args
    fused = torch.randn(2, q.shape[1] * 64 + 40)
    fused[:, : q.shape[1] * 64] = q[0].reshape(-1)  # both sequences ask the same question
    strided_q = fused[:, : q.shape[1] * 64].view(2, q.shape[1], 64)
    assert not strided_q.is_contiguous()
    prefix_lens = torch.tensor([48, 48], dtype=torch.int32)
    shared = (strided_q, kc, vc, table, prefix_lens, scale, ks, vs, window)
    got = check(shared, seen, num_splits=2)
    torch.testing.assert_close(got[0], got[1], rtol=0, atol=0)
    check((strided_q, kc, vc, table, lens, scale, ks, vs, window), seen)


def test_empty_context_gives_zeros():
    """A batch row of length 0 (padding, e.g. for a fixed-size captured batch) yields zeros."""
    args, seen, _ = build_case([0, 20], 1, 3, 64, 16, torch.float32, seed=2, wild=True)
    for splits in (1, 2):
        got = check(args, seen, num_splits=splits)
        assert (got[0] == 0).all()


def test_rejects_bad_arguments():
    args, _, _ = build_case([5], 2, 2, 64, 16, torch.float32, quant=torch.int8)
    q, kc, vc, table, lens, scale, ks, vs, window = args
    for fn in (paged_decode_attention_torch, paged_decode_attention_triton):
        with pytest.raises(ValueError, match="k_scale"):
            fn(q, kc, vc, table, lens, scale)  # quantized cache without scales
        with pytest.raises(ValueError, match="cache dtype"):
            fn(
                q.half(), kc.float(), vc.float(), table, lens, scale
            )  # a float cache not in q's dtype
        with pytest.raises(ValueError, match="multiple"):
            fn(q[:, :3], kc, vc, table, lens, scale, ks, vs)  # 3 query heads over 2 KV heads
        with pytest.raises(ValueError, match="sliding_window"):
            fn(q, kc, vc, table, lens, scale, ks, vs, 0)
    with pytest.raises(ValueError, match="block_n"):
        paged_decode_attention_triton(q, kc, vc, table, lens, scale, ks, vs, block_n=24)
