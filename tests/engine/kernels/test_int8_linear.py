"""int8 weight-only linear: quantization, the CPU torch paths and the Triton GEMM (interpreter on
the CPU).

Every result is checked against float64 arithmetic on the dequantized weight with a rounding-error
bound per element: |got - ref| <= a * u * |ref| + b * |x| @ |W|.T (u the dtype's unit roundoff, the
second term covers float32 accumulation over K and, on the CPU paths for 16-bit inputs, the scale
rounded to x's dtype). Outputs and workspaces are allocated NaN-filled, so an element the kernel
never writes fails the check.
"""

from __future__ import annotations

import pytest
import torch
from _tolerances import U

from sluice.engine.kernels import int8_linear as il

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
ALLOCATIONS = []


@pytest.fixture(autouse=True)
def nan_outputs(monkeypatch):
    """Every output and split-K workspace the module allocates starts as NaN."""
    ALLOCATIONS.clear()

    def nan_empty(shape, dtype, device):
        ALLOCATIONS.append(tuple(shape))
        return torch.full(shape, float("nan"), dtype=dtype, device=device)

    monkeypatch.setattr(il, "_empty", nan_empty)


@pytest.fixture(params=["pack", "mm", "mm_chunked"])
def cpu_path(request, monkeypatch):
    """Force each branch of int8_linear_torch: the fused int8 op, one matmul, row-sliced matmuls."""
    rows = 10**9 if request.param == "pack" else 0
    monkeypatch.setattr(il, "_PACK_MAX_ROWS", dict.fromkeys(il._PACK_MAX_ROWS, rows))
    if request.param == "mm_chunked":
        monkeypatch.setattr(
            il, "_CHUNK_ELEMS", 700
        )  # K=96: 7 rows a slice, N=80 ends on a partial one
    return request.param


def _weight(n, k, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.05
    w *= torch.logspace(-1, 1, n)[torch.randperm(n, generator=g)][
        :, None
    ]  # rows 100x apart in size
    return w.to(dtype).to(DEVICE)


def _x(m, k, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(m, k, generator=g).to(dtype).to(DEVICE)


def _layer(n, k, seed, bias):
    q, s = il.quantize_int8(_weight(n, k, seed))
    b = _x(1, n, torch.float32, seed + 1)[0] if bias else None
    return q, s, b


def _assert_matches(got, x, q, s, b, *, rel_out, rel_mag):
    """|got - ref| <= rel_out * |ref| + rel_mag * (|x| @ |q*s|.T + |b|), ref in float64."""
    w = q.double() * s.double()[:, None]
    xd = x.double().reshape(-1, x.shape[-1])
    ref, mag = xd @ w.T, xd.abs() @ w.abs().T
    if b is not None:
        ref, mag = ref + b.double(), mag + b.double().abs()
    ref, mag = ref.reshape(*x.shape[:-1], -1), mag.reshape(*x.shape[:-1], -1)
    assert got.dtype == x.dtype and got.shape == ref.shape
    assert not got.isnan().any(), f"{int(got.isnan().sum())} output elements never written"
    err = (got.double() - ref).abs()
    bad = err > rel_out * ref.abs() + rel_mag * mag
    assert not bad.any(), (
        f"{int(bad.sum())}/{bad.numel()} elements off; worst error {err.max().item():.3g} "
        f"(|ref| there {ref.abs().flatten()[err.argmax()].item():.3g})"
    )


def _bounds(dtype, k, *, torch_path):
    acc = (k + 3) * 2.0**-24  # float32 accumulation of K products, scale and bias
    if dtype == torch.float32:
        return dict(rel_out=2 * U[dtype], rel_mag=acc)
    if not torch_path:  # one rounding of the float32 result (the interpreter truncates: 2u)
        return dict(rel_out=2 * U[dtype], rel_mag=acc)
    # the fused op rounds the scale to x's dtype; the matmul paths round before the scale
    slack = (
        2 * U[dtype] if DEVICE == "cuda" else 0.0
    )  # cuBLAS may reduce 16-bit partials in 16 bits
    return dict(rel_out=3 * U[dtype], rel_mag=acc + U[dtype] + slack)


# --- quantization -------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
def test_quantize_round_trip_within_half_a_step(dtype):
    w = _weight(80, 96, seed=1, dtype=dtype)
    w[3] = 0.0  # all-zero row
    w[7] = 0.0
    w[7, 5] = -0.3  # a single non-zero entry
    q, s = il.quantize_int8(w)
    assert q.dtype == torch.int8 and q.shape == w.shape and q.is_contiguous()
    assert s.dtype == torch.float32 and s.shape == (80,)
    wd = w.double()
    absmax = wd.abs().amax(dim=1)
    nonzero = absmax > 0
    # scale = absmax / 127 (float64 check), the all-zero row gets the positive floor and zero codes
    torch.testing.assert_close(s.double()[nonzero], absmax[nonzero] / 127, rtol=2**-23, atol=0)
    assert s[3].item() == torch.tensor(il.SCALE_FLOOR).item() > 0 and (q[3] == 0).all()
    # the largest entry of each non-zero row maps to +-127, nothing goes past it
    assert (q.abs().amax(dim=1)[nonzero] == 127).all() and q.abs().max() <= 127
    assert q[7, 5] == -127 and (q[7].abs().sum() == 127)
    # round trip: within half a quantization step of the original (plus the float32 rounding of
    # w / scale, which can turn 63.4999999 into a tie: half an ulp of a quotient below 128)
    err = (q.double() * s.double()[:, None] - wd).abs()
    assert (err <= s.double()[:, None] * (0.5 + 2**-17)).all()
    # the codes are round(w / scale): compare with float64 division (ties may land one apart)
    q64 = torch.round(wd / s.double()[:, None])
    assert (q.double() - q64).abs().max() <= 1 and (q.double() != q64).float().mean() < 1e-3


def test_quantize_rejects_non_matrices():
    with pytest.raises(ValueError):
        il.quantize_int8(torch.randn(8))
    with pytest.raises(ValueError):
        il.quantize_int8(torch.ones(4, 4, dtype=torch.int32))


# --- the torch path (reference and CPU) ---------------------------------------------------------


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", [1, 5, 33])
def test_torch_path_matches_float64(cpu_path, m, dtype, bias):
    k = 96
    q, s, b = _layer(80, k, seed=m, bias=bias)
    x = _x(m, k, dtype, seed=100 + m)
    _assert_matches(
        il.int8_linear_torch(x, q, s, b), x, q, s, b, **_bounds(dtype, k, torch_path=True)
    )


def test_torch_path_strided_and_batched_input(cpu_path):
    k = 96
    q, s, b = _layer(80, k, seed=3, bias=True)
    wide = _x(6, k + 10, torch.bfloat16, seed=4)
    x = wide[:, 5 : 5 + k]
    assert not x.is_contiguous()
    _assert_matches(
        il.int8_linear_torch(x, q, s, b), x, q, s, b, **_bounds(torch.bfloat16, k, torch_path=True)
    )
    x3 = _x(6, k, torch.float32, seed=5).reshape(2, 3, k)
    _assert_matches(
        il.int8_linear_torch(x3, q, s, b), x3, q, s, b, **_bounds(torch.float32, k, torch_path=True)
    )


def test_float16_tiny_scales_stay_accurate(monkeypatch):
    """The fused op takes float16 scales; scales below float16's normal range must not go that
    way."""
    monkeypatch.setattr(il, "_PACK_MAX_ROWS", dict.fromkeys(il._PACK_MAX_ROWS, 10**9))
    k = 96
    q, s = il.quantize_int8(_weight(80, k, seed=6) * 1e-3)
    assert s.min().item() < 2.0**-14
    x = _x(4, k, torch.float16, seed=7) * 100
    _assert_matches(
        il.int8_linear_torch(x, q, s), x, q, s, None, **_bounds(torch.float16, k, torch_path=True)
    )


def test_float16_large_activations_do_not_overflow(cpu_path):
    """x @ codes (before the scale) is ~127 / absmax(row) times the output: past 65504 here."""
    k = 96
    q, s, b = _layer(80, k, seed=20, bias=True)
    x = _x(5, k, torch.float16, seed=21) * 300
    assert (x.double() @ q.double().T).abs().max() > 65504
    _assert_matches(
        il.int8_linear_torch(x, q, s, b), x, q, s, b, **_bounds(torch.float16, k, torch_path=True)
    )
    if cpu_path == "pack":  # the kernel once: it has a single path
        _assert_matches(
            il.int8_linear_triton(x, q, s, b),
            x,
            q,
            s,
            b,
            **_bounds(torch.float16, k, torch_path=False),
        )


def test_default_dispatch_and_empty_shapes():
    """The thresholds as shipped (small batches on the fused op, larger on matmuls), and M = 0,
    K = 0."""
    for m in (1, 2, 17, 40):
        for dtype in DTYPES:
            q, s, b = _layer(80, 96, seed=m, bias=True)
            x = _x(m, 96, dtype, seed=m)
            _assert_matches(
                il.int8_linear_torch(x, q, s, b), x, q, s, b, **_bounds(dtype, 96, torch_path=True)
            )
    q, s, b = _layer(80, 96, seed=8, bias=True)
    for fn in (il.int8_linear_torch, il.int8_linear_triton):
        assert fn(_x(0, 96, torch.float32, seed=9), q, s, b).shape == (0, 80)
        q0, s0 = il.quantize_int8(torch.zeros(80, 0, device=DEVICE))
        torch.testing.assert_close(fn(_x(3, 0, torch.float32, seed=9), q0, s0, b), b.expand(3, 80))


def test_rejects_mismatched_arguments():
    q, s, b = _layer(80, 96, seed=10, bias=True)
    x = _x(2, 96, torch.float32, seed=11)
    for fn in (il.int8_linear_torch, il.int8_linear_triton):
        with pytest.raises(ValueError):
            fn(_x(2, 95, torch.float32, seed=11), q, s)
        with pytest.raises(ValueError):
            fn(x, q, s[:-1])
        with pytest.raises(ValueError):
            fn(x, q, s, b[:-1])
        with pytest.raises(ValueError):
            fn(x, q.float(), s)
        with pytest.raises(ValueError):
            fn(x.double(), q, s)


# --- the Triton GEMM ------------------------------------------------------------------------------


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "m,n,k", [(1, 80, 96), (1, 80, 300), (5, 80, 96), (33, 80, 96), (70, 130, 100)]
)
def test_triton_matches_float64(m, n, k, dtype, bias):
    """Decode (split-K for m=1, k=300 and m=33), single-pass and prefill tile configs."""
    q, s, b = _layer(n, k, seed=m * 31 + k, bias=bias)
    x = _x(m, k, dtype, seed=200 + m)
    got = il.int8_linear_triton(x, q, s, b)
    assert (m, n) in ALLOCATIONS  # the NaN-filled output is the one returned
    _assert_matches(got, x, q, s, b, **_bounds(dtype, k, torch_path=False))


def test_triton_strided_and_batched_input():
    k = 100
    q, s, b = _layer(70, k, seed=12, bias=True)
    wide = _x(9, k + 20, torch.bfloat16, seed=13)
    x = wide[:, 7 : 7 + k]
    _assert_matches(
        il.int8_linear_triton(x, q, s, b),
        x,
        q,
        s,
        b,
        **_bounds(torch.bfloat16, k, torch_path=False),
    )
    x3 = _x(6, k, torch.float16, seed=14).reshape(3, 2, k)
    _assert_matches(
        il.int8_linear_triton(x3, q, s, b),
        x3,
        q,
        s,
        b,
        **_bounds(torch.float16, k, torch_path=False),
    )


@pytest.mark.parametrize("split_k", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_small_tiles_into_a_slice(split_k, dtype):
    """Tiles smaller than the problem in every dim (masked edges, several K steps, uneven K slices,
    one of them empty), written into a column slice of a NaN buffer that must stay NaN around it."""
    m, n, k = 19, 70, 100  # K in 32-steps: 4 blocks, 3 slices of 2, 2 and 0 blocks
    q, s, b = _layer(n, k, seed=15, bias=True)
    x = _x(m, k, dtype, seed=16)
    buf = torch.full((m, n + 9), float("nan"), dtype=dtype, device=DEVICE)
    out = buf[:, 4 : 4 + n]
    cfg = il.GemmConfig(block_m=16, block_n=32, block_k=32, split_k=split_k, group_m=2)
    il._int8_matmul(x, q, s, b, out, cfg)
    assert ALLOCATIONS == ([(split_k, m, n)] if split_k > 1 else [])  # the NaN workspace was used
    _assert_matches(out, x, q, s, b, **_bounds(dtype, k, torch_path=False))
    assert buf[:, :4].isnan().all() and buf[:, 4 + n :].isnan().all()


def test_pick_config_tiles_and_splits():
    for m in (1, 7, 16, 17, 64, 65, 4096):
        for n, k in ((576, 576), (960, 576), (576, 1536), (49152, 576), (80, 96), (7, 5000)):
            for dtype in (torch.float32, torch.bfloat16):
                cfg = il.pick_config(m, n, k, dtype, torch.device("cpu"))
                assert min(cfg.block_m, cfg.block_n, cfg.block_k) >= 16  # tl.dot's minimum
                assert cfg.block_m >= min(m, 16) and (m <= 64 or cfg.block_m == 128)
                k_blocks = -(-k // cfg.block_k)
                per = -(-k_blocks // cfg.split_k)
                assert (
                    1 <= cfg.split_k <= max(k_blocks, 1) and (cfg.split_k - 1) * per < k_blocks
                )  # none empty
                assert cfg.split_k == 1 or m <= 64
    assert il.pick_config(1, 80, 300, torch.bfloat16, torch.device("cpu")).split_k > 1


# --- quantized vs float layer ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "fn", [il.int8_linear_torch, il.int8_linear_triton], ids=["torch", "triton"]
)
def test_quantized_layer_close_to_float_layer(fn):
    """Rounding each weight moves it at most scale/2, so |y_q - y| <= sum_k |x_k| * scale_n / 2."""
    m, n, k = 9, 80, 96
    w = _weight(n, k, seed=17)
    b = _x(1, n, torch.float32, seed=18)[0]
    x = _x(m, k, torch.float32, seed=19)
    q, s = il.quantize_int8(w)
    got = fn(x, q, s, b).double()
    want = x.double() @ w.double().T + b.double()
    bound = x.double().abs().sum(dim=1, keepdim=True) * s.double()[None, :] / 2
    assert ((got - want).abs() <= bound * (1 + 1e-4) + 1e-6).all()
    rel = (got - want).norm() / want.norm()
    assert 1e-5 < rel < 1e-2, rel  # a real quantization error, and a small one
