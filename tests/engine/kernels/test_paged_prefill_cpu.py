"""Prefill attention in C (`cpu_kernels.paged_prefill`) against float64: chunks that start their
sequence, chunks after cached context, a chunk sharing its sequence's first blocks with another,
chunks shorter than a tile and spanning many, a sliding window. Cache slots past each sequence's
end hold NaN, and so does every row of the output the kernel must not write."""

from __future__ import annotations

import pytest
import torch

from sluice.engine.cpu_kernels.paged_prefill import paged_prefill_cpu, supports

BS = 16


def build(q_lens, seq_lens, hkv, group, d, seed, share=False, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    nblk = [-(-s // BS) for s in seq_lens]
    num_blocks = 2 * sum(nblk) + 3
    perm = torch.randperm(num_blocks, generator=g)
    width = max(nblk) + 2
    table = (
        perm[-1].repeat(len(seq_lens), width).clone()
    )  # padding names an unused (poisoned) block
    used = 0
    for i, nb in enumerate(nblk):
        table[i, :nb] = perm[used : used + nb]
        used += nb
    if share:  # the last chunk's sequence shares its first block with the one before
        table[-1, 0] = table[-2, 0]
    k = torch.randn(num_blocks, hkv, BS, d, generator=g)
    v = torch.randn(num_blocks, hkv, BS, d, generator=g)
    live = torch.zeros(num_blocks, BS, dtype=torch.bool)
    for i, s in enumerate(seq_lens):
        pos = torch.arange(s)
        live[table[i, pos // BS], pos % BS] = True
    k = k.masked_fill(~live[:, None, :, None], float("nan"))
    v = v.masked_fill(~live[:, None, :, None], float("nan"))
    # q rows of all chunks back to back, one spare row between chunks, inside a wider matrix
    starts, row = [], 1
    for n in q_lens:
        starts.append(row)
        row += n + 1
    hq = hkv * group
    wide = torch.randn(row, hq * d + 3 * d, generator=g) * 2
    q = wide[:, : hq * d].view(row, hq, d)
    return (
        q.to(dtype),
        k.to(dtype),
        v.to(dtype),
        table.to(torch.int32),
        torch.tensor(starts),
        d**-0.5,
    )


def reference(q, k, v, table, starts, q_lens, seq_lens, scale, window):
    hq = q.shape[1]
    hkv = k.shape[1]
    out = {}
    for i, (start, n, s) in enumerate(zip(starts.tolist(), q_lens, seq_lens)):
        pos = torch.arange(s)
        kk = (
            k[table[i, pos // BS].long(), :, pos % BS].double().repeat_interleave(hq // hkv, dim=1)
        )  # [s, Hq, D]
        vv = v[table[i, pos // BS].long(), :, pos % BS].double().repeat_interleave(hq // hkv, dim=1)
        for j in range(n):
            qpos = s - n + j
            visible = pos <= qpos
            if window:
                visible &= pos > qpos - window
            sc = torch.einsum("hd,lhd->hl", q[start + j].double(), kk[visible]) * scale
            out[start + j] = torch.einsum("hl,lhd->hd", torch.softmax(sc, dim=-1), vv[visible])
    return out


def run(q, k, v, table, starts, q_lens, seq_lens, scale, window=None, k_scale=None, v_scale=None):
    out = torch.full_like(q, float("nan"))
    paged_prefill_cpu(
        q,
        out,
        starts,
        torch.tensor(q_lens, dtype=torch.int32),
        torch.tensor(seq_lens, dtype=torch.int32),
        k,
        v,
        table,
        scale,
        window,
        k_scale,
        v_scale,
    )
    return out


def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[nb, Hkv, bs, D] with NaN in dead slots -> (int8 with 127 in dead slots, scales [nb, Hkv]
    (NaN where a block holds nothing live), the dequantized values with NaN kept in dead slots)."""
    dead = x.isnan()
    scale = x.nan_to_num(0).abs().amax(dim=(2, 3)) / 127
    scale = torch.where(scale > 0, scale, torch.tensor(float("nan")))
    stored = (x / scale[..., None, None]).round().clamp(-127, 127).nan_to_num(127).to(torch.int8)
    stored = torch.where(dead, torch.tensor(127, dtype=torch.int8), stored)
    seen = (stored.float() * scale[..., None, None]).masked_fill(dead, float("nan"))
    return stored, scale, seen


@pytest.mark.parametrize("hkv,group,d", [(3, 3, 64), (2, 8, 128), (1, 1, 64)])
def test_matches_float64(hkv, group, d):
    # a whole prompt, a chunk after 40 cached tokens, a 2-token tail, a long chunk after 100
    q_lens, seq_lens = [37, 20, 2, 150], [37, 60, 19, 250]
    q, k, v, table, starts, scale = build(q_lens, seq_lens, hkv, group, d, seed=group, share=True)
    out = run(q, k, v, table, starts, q_lens, seq_lens, scale)
    want = reference(q, k, v, table, starts, q_lens, seq_lens, scale, None)
    rows = torch.tensor(sorted(want))
    torch.testing.assert_close(
        out[rows].double(), torch.stack([want[r] for r in sorted(want)]), rtol=1e-5, atol=1e-5
    )
    others = torch.ones(q.shape[0], dtype=torch.bool)
    others[rows] = False
    assert out[others].isnan().all(), "the kernel wrote rows outside the chunks"


@pytest.mark.parametrize("window", [None, 21])
def test_int8_cache_read_directly(window):
    q_lens, seq_lens = [37, 20, 150], [37, 60, 250]
    q, k, v, table, starts, scale = build(q_lens, seq_lens, 3, 3, 64, seed=4, share=True)
    (kq, ks, k_seen), (vq, vs, v_seen) = quantize_int8(k), quantize_int8(v)
    out = run(q, kq, vq, table, starts, q_lens, seq_lens, scale, window, ks, vs)
    want = reference(q, k_seen, v_seen, table, starts, q_lens, seq_lens, scale, window)
    for r, w in want.items():
        torch.testing.assert_close(out[r].double(), w, rtol=1e-5, atol=1e-5)
    exact = reference(q, k, v, table, starts, q_lens, seq_lens, scale, window)  # unquantized values
    err = max((out[r].double() - w).abs().max().item() for r, w in exact.items())
    assert 1e-6 < err < 0.1, err


def test_sliding_window():
    q_lens, seq_lens = [50, 30], [50, 90]
    q, k, v, table, starts, scale = build(q_lens, seq_lens, 2, 3, 64, seed=9)
    out = run(q, k, v, table, starts, q_lens, seq_lens, scale, window=21)
    want = reference(q, k, v, table, starts, q_lens, seq_lens, scale, 21)
    for r, w in want.items():
        torch.testing.assert_close(out[r].double(), w, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("cache", [torch.bfloat16, torch.int8])
@pytest.mark.parametrize("hkv,group,d,window", [(3, 3, 64, None), (2, 8, 128, 21)])
def test_bfloat16_queries(hkv, group, d, window, cache):
    """bfloat16 queries and outputs on a bfloat16 (or int8) cache: within half a bfloat16 step of
    float64 on the same inputs (float32 inside, one rounding at the end)."""
    q_lens, seq_lens = [37, 20, 2, 150], [37, 60, 19, 250]
    q, k, v, table, starts, scale = build(
        q_lens, seq_lens, hkv, group, d, seed=d, share=True, dtype=torch.bfloat16
    )
    scales = (None, None)
    if cache == torch.int8:
        (k, ks, _), (v, vs, _) = quantize_int8(k.float()), quantize_int8(v.float())
        scales = (ks, vs)
    out = run(q, k, v, table, starts, q_lens, seq_lens, scale, window, *scales)
    assert out.dtype == torch.bfloat16
    seen = [
        c if s is None else c.float() * s[..., None, None]
        for c, s in ((k, scales[0]), (v, scales[1]))
    ]
    want = reference(q, *seen, table, starts, q_lens, seq_lens, scale, window)
    for r, w in want.items():
        err = (out[r].double() - w).abs()
        assert (err <= w.abs() * 2.0**-8 + 1e-5).all(), (r, err.max())
    others = torch.ones(q.shape[0], dtype=torch.bool)
    others[torch.tensor(sorted(want))] = False
    assert out[others].isnan().all(), "the kernel wrote rows outside the chunks"


def test_supports_the_vectorized_shapes_only():
    k16 = torch.zeros(4, 2, 16, 64)
    assert supports(torch.zeros(3, 6, 64), k16)
    assert not supports(torch.zeros(3, 6, 64), torch.zeros(4, 2, 8, 64))  # block size 8
    assert not supports(torch.zeros(3, 6, 80), torch.zeros(4, 2, 16, 80))  # head size 80
    assert supports(torch.zeros(3, 6, 64, dtype=torch.bfloat16), k16.bfloat16())
    assert not supports(torch.zeros(3, 6, 64, dtype=torch.bfloat16), k16)  # a cache of another type
    assert not supports(torch.zeros(3, 6, 64), k16.bfloat16())
    assert supports(torch.zeros(3, 6, 64), k16.to(torch.int8))


@pytest.mark.parametrize("cache", ["float32", "bfloat16", "int8"])
@pytest.mark.parametrize("window", [None, 21])
def test_a_position_gets_the_same_bits_however_its_sequence_is_split(cache, window):
    """Deterministic mode relies on this: a query row is a lane of its own and keys past its
    position add exact zeros, so a token computed in a whole prompt, in a later chunk, or alone as
    a decode (a chunk of one) attends to the same bits."""
    n = 90
    dtype = torch.bfloat16 if cache == "bfloat16" else torch.float32
    q, k, v, table, starts, scale = build([n], [n], 3, 3, 64, seed=5, dtype=dtype)
    scales = (None, None)
    if cache == "int8":
        (k, ks, _), (v, vs, _) = quantize_int8(k), quantize_int8(v)
        scales = (ks, vs)
    first = int(starts[0])

    def split(chunks: list[tuple[int, int]]) -> torch.Tensor:
        """Rows of positions 0..n-1 with the sequence cut into (q_len, seq_len) chunks."""
        q_lens, seq_lens = [c[0] for c in chunks], [c[1] for c in chunks]
        at = torch.tensor([first + s - m for m, s in chunks])
        tables = table.expand(len(chunks), -1)
        out = run(q, k, v, tables, at, q_lens, seq_lens, scale, window, *scales)
        return out[first : first + n]

    whole = split([(n, n)])
    assert not whole.isnan().any()
    for chunks in ([(37, 37), (1, 38), (1, 39), (51, n)], [(1, p + 1) for p in range(n)]):
        assert torch.equal(split(chunks), whole), chunks
