"""Paged decode attention in C (`sluice.engine.cpu_kernels`) against float64 and the torch path.

The caches come from test_paged_attention.build_case: scattered blocks, NaN in every slot no query
may attend, block-table padding naming poisoned blocks (or wild ids). The kernel writes only the
rows of its decode tokens, so the other rows of a NaN-filled output must stay NaN.
"""

from __future__ import annotations

import pytest
import torch
from test_paged_attention import LENS, attention_f64, build_case

from sluice.engine import cpu_kernels
from sluice.engine.cpu_kernels.paged_decode import paged_decode_cpu, supports
from sluice.engine.errors import EngineError
from sluice.engine.kernel_ops import resolve_kernel_ops
from sluice.engine.kernels.paged_attention import paged_decode_attention_torch


def test_the_kernels_build_on_this_machine():
    # CI has a C compiler: the native path must really run there, not fall back silently.
    assert cpu_kernels.library() is not None, cpu_kernels.unavailable_reason()
    assert resolve_kernel_ops("auto", "cpu").name == "native"


def run_native(args, *, stride_pad: int = 0, extra_rows: int = 0):
    """The kernel on decode rows placed among other rows (extra_rows before each) of a wider q
    (stride_pad more elements per row, like q inside the fused qkv), output NaN-filled first."""
    q, k_cache, v_cache, table, lens, scale, k_scale, v_scale, window = args
    n, hq, d = q.shape
    rows = n * (extra_rows + 1)
    tokens = torch.arange(n, dtype=torch.int64) * (extra_rows + 1) + extra_rows
    wide = torch.full((rows, hq * d + stride_pad), float("nan"), dtype=q.dtype)
    q_rows = wide[:, : hq * d].view(rows, hq, d)
    q_rows[tokens] = q
    out = torch.full((rows, hq, d), float("nan"), dtype=q.dtype)
    paged_decode_cpu(
        q_rows,
        out,
        tokens,
        k_cache,
        v_cache,
        table,
        lens,
        scale,
        window,
        int(lens.max()),
        k_scale,
        v_scale,
    )
    others = torch.ones(rows, dtype=torch.bool)
    others[tokens] = False
    assert out[others].isnan().all(), "the kernel wrote rows that are not its decode tokens"
    got = out[tokens]
    assert torch.isfinite(got).all(), "an output element was not written (or NaN leaked in)"
    return got


def check(args, seen, **kw):
    q, _, _, table, lens, scale, _, _, window = args
    got = run_native(args, **kw)
    f64 = attention_f64(q, *seen, table, lens, scale, window)
    torch.testing.assert_close(got.double(), f64, rtol=1e-5, atol=1e-5)
    ref = paged_decode_attention_torch(*args)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


# (KV heads, G, head dim, block size): the vectorized path (block 16, D 64 or 128, G <= 16) and
# the generic one (D not a multiple of 16, block 8, G over 16). The vectorized path takes a head's
# queries in groups (of 4 for D 64, of 2 for D 128): G 7 and 5 leave a smaller last group.
CASES = [
    (2, 1, 64, 16),
    (3, 3, 64, 16),
    (2, 8, 128, 16),
    (1, 7, 64, 16),
    (2, 5, 128, 16),
    (2, 3, 80, 16),
    (2, 3, 64, 8),
    (1, 20, 64, 16),
]


@pytest.mark.parametrize("hkv,group,d,bs", CASES, ids=lambda v: str(v))
def test_matches_float64_and_the_torch_path(hkv, group, d, bs):
    args, seen, _ = build_case(
        LENS + [33], hkv, group, d, bs, torch.float32, share=1, seed=group + d
    )
    check(args, seen)
    check(
        args, seen, stride_pad=2 * hkv * d, extra_rows=2
    )  # q rows inside qkv, prefill rows between


@pytest.mark.parametrize("bs", [16, 8])
def test_sliding_window_never_reads_before_it(bs):
    lens = [1, 5, 16, 40, 300]
    args, seen, _ = build_case(lens, 2, 3, 64, bs, torch.float32, window=37, seed=3, wild=True)
    check(args, seen)


@pytest.mark.parametrize(
    "hkv,group,d,window", [(3, 3, 64, None), (2, 8, 128, 37), (1, 1, 64, None)]
)
def test_int8_cache_read_directly(hkv, group, d, window):
    """int8 values and per-(block, head) scales (127 in unused slots, NaN scales on unused blocks):
    the kernel dequantizes as it reads and agrees with the torch reference and with float64 on the
    dequantized values; against the unquantized values only as close as int8 allows."""
    args, seen, raw = build_case(
        LENS + [33],
        hkv,
        group,
        d,
        16,
        torch.float32,
        quant=torch.int8,
        window=window,
        share=1,
        seed=11 + d,
    )
    check(args, seen)
    q, _, _, table, lens, scale, _, _, window = args
    exact = attention_f64(q, *raw, table, lens, scale, window)
    err = (run_native(args).double() - exact).abs().max().item()
    assert 1e-6 < err < 0.1, err  # a missing or wrong scale is off by far more (values ~absmax/127)


def test_int8_needs_the_vectorized_shape():
    assert supports(torch.zeros(3, 6, 64), torch.zeros(4, 2, 16, 64, dtype=torch.int8))
    assert not supports(torch.zeros(3, 6, 64), torch.zeros(4, 2, 8, 64, dtype=torch.int8))
    assert not supports(torch.zeros(3, 6, 80), torch.zeros(4, 2, 16, 80, dtype=torch.int8))


@pytest.mark.parametrize(
    "hkv,group,d,dtype,quant,window,threads",
    [
        (3, 3, 64, torch.float32, None, None, 2),
        (3, 3, 64, torch.bfloat16, None, None, 2),
        (3, 3, 64, torch.bfloat16, torch.int8, 37, 3),
        (2, 8, 128, torch.float32, torch.int8, None, 3),
        (2, 3, 80, torch.float32, None, None, 2),  # the generic path: a KV head a thread
    ],
)
def test_a_lone_sequence_is_shared_out_over_the_threads(
    hkv, group, d, dtype, quant, window, threads
):
    """A single decoding sequence on several threads: its context is cut into one run of blocks a
    thread, each run with its own softmax, and the runs merged by their maxima and sums (the
    generic path: a KV head a thread). Each output is as close to float64 as a batch's: 1e-5 in
    float32, half a bfloat16 step in bfloat16; contexts of fewer blocks than threads (a run with
    nothing to read) and windows starting inside a block included."""
    lens = [300, 33, 1000, 16, 5, 700]
    args, seen, _ = build_case(lens, hkv, group, d, 16, dtype, quant=quant, window=window, seed=d)
    q, k_cache, v_cache, table, seq_lens, scale, k_scale, v_scale, window = args
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        for i in range(len(lens)):
            one = slice(i, i + 1)
            alone = (q[one], k_cache, v_cache, table[one], seq_lens[one], scale, k_scale, v_scale)
            got = run_native((*alone, window)).double()
            f64 = attention_f64(q[one], *seen, table[one], seq_lens[one], scale, window)
            if dtype == torch.float32:
                torch.testing.assert_close(got, f64, rtol=1e-5, atol=1e-5, msg=f"sequence {i}")
            else:
                err = (got - f64).abs()
                assert (err <= f64.abs() * 2.0**-8 + 1e-5).all(), (i, err.max())
    finally:
        torch.set_num_threads(before)


def test_one_long_context():
    args, seen, _ = build_case([4100], 1, 3, 64, 16, torch.float32, seed=5)
    check(args, seen)


@pytest.mark.parametrize(
    "hkv,group,d,quant,window",
    [
        (3, 3, 64, None, None),
        (2, 8, 128, None, 37),
        (3, 3, 64, torch.int8, None),
        (1, 1, 128, torch.int8, 21),
    ],
)
def test_bfloat16_queries(hkv, group, d, quant, window):
    """bfloat16 queries and outputs on a bfloat16 (or int8) cache: float32 arithmetic inside, one
    rounding at the end, so every output is within half a bfloat16 step of float64 on the same
    inputs."""
    args, seen, _ = build_case(
        LENS + [33],
        hkv,
        group,
        d,
        16,
        torch.bfloat16,
        quant=quant,
        window=window,
        share=1,
        seed=21 + d,
    )
    q, k_cache, _, table, lens, scale, _, _, window = args
    assert k_cache.dtype == (quant or torch.bfloat16)
    f64 = attention_f64(q, *seen, table, lens, scale, window)
    for kw in ({}, {"stride_pad": 2 * hkv * d, "extra_rows": 2}):
        got = run_native(args, **kw)
        assert got.dtype == torch.bfloat16
        err = (got.double() - f64).abs()
        assert (err <= f64.abs() * 2.0**-8 + 1e-5).all(), err.max()


def test_bfloat16_without_the_dot_instruction(monkeypatch):
    """Built without AVX512-BF16's instructions (as on CPUs that lack them), bfloat16 blocks are
    widened to float32 first and roundings done in integer arithmetic; decode, prefill and the
    layer ops keep the same bounds."""
    import test_layer_ops_cpu as layer_ops
    from test_paged_prefill_cpu import (
        test_a_position_gets_the_same_bits_however_its_sequence_is_split as prefill_split,
    )
    from test_paged_prefill_cpu import test_bfloat16_queries as prefill_bfloat16_queries

    monkeypatch.setattr(cpu_kernels, "_state", {})  # (kept in the cache, keyed by the flags)
    monkeypatch.setenv("SLUICE_NATIVE_CFLAGS", "-DSLUICE_NO_BF16_DOT")
    assert cpu_kernels.library() is not None, cpu_kernels.unavailable_reason()
    test_bfloat16_queries(2, 8, 128, None, 37)
    test_bfloat16_queries(3, 3, 64, None, None)
    prefill_bfloat16_queries(3, 3, 64, 21, torch.bfloat16)
    prefill_split("bfloat16", 21)
    layer_ops.test_add_rmsnorm_bfloat16(300, True)
    layer_ops.test_silu_and_mul(300, torch.bfloat16)
    layer_ops.test_rotary_in_place(7, 9, 3, 64, torch.bfloat16)


def test_which_query_and_cache_types_it_serves():
    k = torch.zeros(4, 2, 16, 64)
    q32, q16 = torch.zeros(3, 6, 64), torch.zeros(3, 6, 64, dtype=torch.bfloat16)
    assert supports(q32, k) and supports(q16, k.bfloat16()) and supports(q16, k.to(torch.int8))
    assert (
        not supports(q16, k)
        and not supports(q32, k.bfloat16())
        and not supports(q32.half(), k.half())
    )
    assert not supports(
        q16, torch.zeros(4, 2, 8, 64, dtype=torch.bfloat16)
    )  # bfloat16: vectorized shapes only
    args, _, _ = build_case([5, 40], 2, 3, 64, 16, torch.bfloat16, seed=2)
    with pytest.raises(ValueError, match="bfloat16"):  # outputs of another type than the queries
        paged_decode_cpu(
            args[0], torch.empty(2, 6, 64), torch.arange(2), *args[1:5], args[5], None, 40
        )


def test_without_the_kernels_auto_falls_back_and_native_names_the_reason(monkeypatch):
    monkeypatch.setattr(cpu_kernels, "_state", {})
    monkeypatch.setenv("SLUICE_NATIVE_KERNELS", "0")
    assert cpu_kernels.library() is None
    assert "SLUICE_NATIVE_KERNELS=0" in cpu_kernels.unavailable_reason()
    assert resolve_kernel_ops("auto", "cpu").name == "torch"
    with pytest.raises(EngineError, match="SLUICE_NATIVE_KERNELS=0") as e:
        resolve_kernel_ops("native", "cpu")
    assert e.value.field == "kernels"


def test_a_missing_compiler_is_named(monkeypatch):
    monkeypatch.setattr(cpu_kernels, "_state", {})
    monkeypatch.setenv("CC", "no-such-compiler-here")
    assert cpu_kernels.library() is None
    assert "no-such-compiler-here" in cpu_kernels.unavailable_reason()


def test_native_is_for_the_cpu_only():
    with pytest.raises(EngineError, match="CPU"):
        resolve_kernel_ops("native", "cuda")


def test_an_unwritable_cache_dir_is_named(monkeypatch, tmp_path):
    monkeypatch.setattr(cpu_kernels, "_state", {})
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("SLUICE_CACHE_DIR", str(blocker))
    assert cpu_kernels.library() is None
    assert "SLUICE_CACHE_DIR" in cpu_kernels.unavailable_reason()


def test_a_fresh_cache_dir_builds_and_runs(monkeypatch, tmp_path):
    monkeypatch.setattr(cpu_kernels, "_state", {})
    monkeypatch.setenv("SLUICE_CACHE_DIR", str(tmp_path))
    assert cpu_kernels.library() is not None, cpu_kernels.unavailable_reason()
    assert list((tmp_path / "cpu_kernels").glob("*.so"))
    args, seen, _ = build_case([5, 40], 2, 3, 64, 16, torch.float32, seed=2)
    check(args, seen)
