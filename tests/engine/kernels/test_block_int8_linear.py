"""Quantized weights multiplied as stored (`cpu_kernels.block_int8_linear`): blocks of 32 codes
along K, int8 with float16 scales (Q8_0), 4-bit or 5-bit with float16 scales and minimums (Q4_1,
Q5_*), or 6-bit with an int8 scale each 16 and a float16 one each 256 (Q6_K), activations
quantized per block of 32 in the call, exact int32 block dot products (VNNI where the CPU has it).

Checked against float64 two ways: with the activations quantized as the kernel's contract says
(then only float32 roundoff may differ), and against the unquantized product, within the bound the
two quantizations allow. A row's bits do not depend on the rows beside it or the thread count, and
the portable build (no VNNI) gives the same bits."""

from __future__ import annotations

import gguf
import pytest
import torch

from sluice.engine import cpu_kernels
from sluice.engine.cpu_kernels.block_int8_linear import (
    BLOCK,
    block_int8_linear,
    block_int8_rows,
    dequantize_blocks,
    dequantize_q4_blocks,
    dequantize_q6_blocks,
    dot_path,
    pack_blocks,
    pack_q4_blocks,
    pack_q5_blocks,
    pack_q6_blocks,
    quantize_blocks,
    quantize_q4_blocks,
    widen_blocks,
)

# SmolLM2's q/k/v and down shapes, a partial last panel with K not a multiple of 32, tiny ones
SHAPES = [(960, 576), (576, 1536), (131, 201), (5, 7), (17, 32)]
ROWS = [1, 2, 3, 4, 5, 9, 64, 97, 300]
TINY = 1e-30  # the kernel's contract: an activation block with a smaller absmax counts as zeros


def _data(n: int, k: int, dtype: torch.dtype, seed: int = 0, rows: int = 300):
    g = torch.Generator().manual_seed(seed + n + k)
    wide = torch.randn(rows, k + 9, generator=g)  # x as a column view: row stride != K
    x = wide[:, 3 : 3 + k]
    x[7, : min(k, 40)] = 0.0  # an all-zero activation block
    w = torch.randn(n, k, generator=g) * torch.rand(n, 1, generator=g)  # rows of varied scale
    w[0, : min(k, 32)] = 0.0  # an all-zero weight block
    return x.to(dtype), w.to(dtype), torch.randn(n, generator=g).to(dtype)


def quantized_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The activations as the kernel's contract quantizes them: per block of 32 of a row, scale
    absmax / 127, codes round-half-even(x * (127 / absmax)), both in float32 arithmetic."""
    m, k = x.shape
    nb = -(-k // BLOCK)
    padded = torch.zeros(m, nb * BLOCK, dtype=torch.float32)
    padded[:, :k] = x.float()
    blocks = padded.view(m, nb, BLOCK)
    amax = blocks.abs().amax(dim=2, keepdim=True)
    live = amax >= TINY
    inv = torch.where(live, torch.tensor(127.0) / torch.where(live, amax, 1.0), 0.0)
    codes = torch.round(blocks * inv)
    scales = torch.where(live, amax / torch.tensor(127.0), 0.0)
    return codes, scales


def reference(x, codes, scales, k, bias):
    """float64 sum over blocks of (xs * ws) * exact block dot products, and the sum of the terms'
    magnitudes (the float32 roundoff bound's scale)."""
    xq, xs = quantized_activations(x)
    m, n, nb = x.shape[0], codes.shape[0], codes.shape[1] // BLOCK
    wq = codes.double().view(n, nb, BLOCK)
    dots = torch.einsum("mbt,nbt->mnb", xq.double(), wq)  # exact: integers below 2^53
    s = (xs.view(m, 1, nb).float() * scales.float().view(1, n, nb)).double()  # float32 products
    terms = s * dots
    b = 0.0 if bias is None else bias.double()
    return terms.sum(dim=2) + b, terms.abs().sum(dim=2) + (0.0 if bias is None else b.abs())


def check(n, k, dtype, rows=300):
    x, w, b = _data(n, k, dtype, rows=rows)
    codes, scales = quantize_blocks(w)
    packed = pack_blocks(codes, scales, k)
    got = block_int8_linear(x, packed, b)
    assert got.dtype == dtype and got.shape == (x.shape[0], n)
    want, magnitude = reference(x, codes, scales, k, b)
    nb = -(-k // BLOCK)
    # one float32 rounding per block's multiply-add, one for the bias; bfloat16: one more at the end
    tol = (nb + 2) * 2.0**-24 if dtype == torch.float32 else 2.0**-8
    assert ((got.double() - want).abs() <= tol * magnitude + 1e-30).all()
    return got


def reference_q4(x, codes, d, m, bias):
    """The 4-bit contract in float64: per block, (xs * d) * dot(xq, q) + m * (xs * sum(xq)), the
    two float32 products as float32 computes them; and the terms' magnitudes."""
    xq, xs = quantized_activations(x)
    rows, n, nb = x.shape[0], codes.shape[0], codes.shape[1] // BLOCK
    dots = torch.einsum("mbt,nbt->mnb", xq.double(), codes.double().view(n, nb, BLOCK))
    scale = (xs.view(rows, 1, nb).float() * d.float().view(1, n, nb)).double()
    shift = (xs.view(rows, nb) * xq.sum(dim=2)).view(rows, 1, nb).double()  # exact sums
    terms = scale * dots + m.double().view(1, n, nb) * shift
    mags = (scale * dots).abs() + (m.double().view(1, n, nb) * shift).abs()
    b = bias.double()
    return terms.sum(dim=2) + b, mags.sum(dim=2) + b.abs()


def check_q4(n, k, dtype, rows=300):
    x, w, b = _data(n, k, dtype, rows=rows)
    codes, d, m = quantize_q4_blocks(w)
    got = block_int8_linear(x, pack_q4_blocks(codes, d, m, k), b)
    assert got.dtype == dtype and got.shape == (x.shape[0], n)
    want, magnitude = reference_q4(x, codes, d, m, b)
    nb = -(-k // BLOCK)
    tol = (2 * nb + 3) * 2.0**-24 if dtype == torch.float32 else 2.0**-8
    assert ((got.double() - want).abs() <= tol * magnitude + 1e-30).all()
    return got


def q6_operands(n: int, k: int, seed: int = 0):
    """6-bit codes as a Q6_K file holds them (no quantizer here makes them): random codes, every
    int8 scale, float16 d of varied size and sign; one block at the extremes (every code 0, i.e.
    -32, with sc -128: the largest sums the kernel's int32 and float32 conversion must hold) and a
    super-block whose d is 0. Codes past K are 32 (zeros)."""
    g = torch.Generator().manual_seed(seed + 7 * n + k)
    nb = -(-k // BLOCK)
    codes = torch.randint(0, 64, (n, nb * BLOCK), generator=g, dtype=torch.uint8)
    codes[:, k:] = 32
    sc = torch.randint(-128, 128, (n, 2 * nb), generator=g, dtype=torch.int8)
    d = (torch.randn(n, -(-nb // 8), generator=g) * 1e-3).half().repeat_interleave(8, dim=1)[:, :nb]
    codes[-1, :BLOCK], sc[-1, :2] = 0, -128
    d[0, :8] = 0
    return codes, d.contiguous(), sc


def reference_q6(x, codes, d, sc, bias):
    """The 6-bit contract in float64: per block, (xs * d) * isum with isum the exact integer sum of
    sc * (q - 32) * xq over the block's two halves, xs * d as float32 computes it; and the terms'
    magnitudes."""
    xq, xs = quantized_activations(x)
    rows, n, nb = x.shape[0], codes.shape[0], codes.shape[1] // BLOCK
    w = (codes.double() - 32).view(n, 2 * nb, BLOCK // 2) * sc.double().unsqueeze(2)
    isum = torch.einsum("mbt,nbt->mnb", xq.double(), w.view(n, nb, BLOCK))  # exact integers
    assert isum.abs().max() < 2**24  # so the kernel's float32 conversion of it is exact
    scale = (xs.view(rows, 1, nb).float() * d.float().view(1, n, nb)).double()
    terms = scale * isum
    b = bias.double()
    return terms.sum(dim=2) + b, terms.abs().sum(dim=2) + b.abs()


def check_q6(n, k, dtype, rows=300):
    x, _, b = _data(n, k, dtype, rows=rows)
    x[0, : min(k, BLOCK)] = -3.0  # with the extreme block: every code -127
    codes, d, sc = q6_operands(n, k)
    got = block_int8_linear(x, pack_q6_blocks(codes, d, sc, k), b)
    assert got.dtype == dtype and got.shape == (x.shape[0], n)
    want, magnitude = reference_q6(x, codes, d, sc, b)
    nb = -(-k // BLOCK)
    tol = (nb + 2) * 2.0**-24 if dtype == torch.float32 else 2.0**-8
    assert ((got.double() - want).abs() <= tol * magnitude + 1e-30).all()
    return got


def q5_operands(n: int, k: int, seed: int = 0):
    """5-bit codes as a file holds them (random, one block all 31 and one all 0) with float16 d
    and m of varied size and sign; codes past K are 0."""
    g = torch.Generator().manual_seed(seed + 5 * n + k)
    nb = -(-k // BLOCK)
    codes = torch.randint(0, 32, (n, nb * BLOCK), generator=g, dtype=torch.uint8)
    codes[:, k:] = 0
    codes[0, :BLOCK], codes[-1, :BLOCK] = 31, 0
    d = (torch.randn(n, nb, generator=g) * 1e-2).half()
    m = (torch.randn(n, nb, generator=g) * 1e-1).half()
    return codes, d, m


def check_q5(n, k, dtype, rows=300):
    x, _, b = _data(n, k, dtype, rows=rows)
    codes, d, m = q5_operands(n, k)
    got = block_int8_linear(x, pack_q5_blocks(codes, d, m, k), b)
    assert got.dtype == dtype and got.shape == (x.shape[0], n)
    want, magnitude = reference_q4(x, codes, d, m, b)  # (the same contract, codes to 31)
    nb = -(-k // BLOCK)
    tol = (2 * nb + 3) * 2.0**-24 if dtype == torch.float32 else 2.0**-8
    assert ((got.double() - want).abs() <= tol * magnitude + 1e-30).all()
    return got


def packed_weight(w: torch.Tensor, bits: int):
    """w quantized and packed in `bits` (8, 4), or a 6-bit weight of its shape (`q6_operands`):
    (the packed weight, the values it stands for)."""
    n, k = w.shape
    if bits == 8:
        codes, scales = quantize_blocks(w)
        return pack_blocks(codes, scales, k), dequantize_blocks(codes, scales, k)
    if bits == 4:
        codes, d, m = quantize_q4_blocks(w)
        return pack_q4_blocks(codes, d, m, k), dequantize_q4_blocks(codes, d, m, k)
    if bits == 5:
        codes, d, m = q5_operands(n, k)
        return pack_q5_blocks(codes, d, m, k), dequantize_q4_blocks(codes, d, m, k)
    codes, d, sc = q6_operands(n, k)
    return pack_q6_blocks(codes, d, sc, k), dequantize_q6_blocks(codes, d, sc, k)


@pytest.mark.parametrize(
    "checked",
    [check, check_q4, check_q5, check_q6],
    ids=["int8", "4-bit", "5-bit", "6-bit"],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,k", SHAPES)
def test_matches_float64_on_the_stored_operands(n, k, dtype, checked):
    """Each format against its contract in float64 (`check`, `check_q4`, `check_q5`, `check_q6`)."""
    checked(n, k, dtype)


def test_6_bit_values_are_those_of_the_codes_exactly():
    """d sc (q - 32) is exact in float32 (|sc (q - 32)| <= 4096 times a float16), so the values
    the kernel stands for are the file's, as float64 computes them."""
    codes, d, sc = q6_operands(33, 256)
    want = (codes.double() - 32).view(33, -1, 16) * sc.double().unsqueeze(2)
    want = want.view(33, -1, BLOCK) * d.double().unsqueeze(2)
    assert torch.equal(dequantize_q6_blocks(codes, d, sc, 256).double(), want.view(33, 256))


def test_quantize_q4_blocks_gives_the_weights_of_a_gguf_q4_1_tensor():
    """Against the gguf package's Q4_1 quantizer (a numpy port of llama.cpp's reference one):
    the same weights after dequantizing, and codes within 0..15 that every block's extremes use."""
    _, w, _ = _data(64, 256, torch.float32)
    raw = gguf.quants.quantize(w.numpy(), gguf.GGMLQuantizationType.Q4_1)
    want = torch.from_numpy(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q4_1))
    codes, d, m = quantize_q4_blocks(w)
    assert codes.dtype == torch.uint8 and codes.max() <= 15
    assert torch.equal(dequantize_q4_blocks(codes, d, m, 256), want.view(64, 256))
    blocks = codes.view(64, 8, 32)
    live = d.float() > 0
    assert (blocks.amin(dim=2)[live] == 0).all() and (blocks.amax(dim=2)[live] == 15).all()


@pytest.mark.parametrize("n,k", SHAPES)
def test_stays_within_the_quantization_bound_of_the_float_product(n, k):
    x, w, b = _data(n, k, torch.float32)
    codes, scales = quantize_blocks(w)
    got = block_int8_linear(x, pack_blocks(codes, scales, k), b).double()
    exact = x.double() @ w.double().T + b.double()
    # |x w - x' w'| <= |x - x'| |w| + |x'| |w - w'|, elementwise errors at most half a step
    xq, xs = quantized_activations(x)
    x_deq = (xq * xs).view(x.shape[0], -1)[:, :k].double()
    x_err = (xs / 2).expand(-1, -1, BLOCK).reshape(x.shape[0], -1)[:, :k].double()
    w_deq = dequantize_blocks(codes, scales, k).double()
    w_err = (w.double() - w_deq).abs()
    bound = x_err @ w.double().abs().T + x_deq.abs() @ w_err.T
    assert ((got - exact).abs() <= bound * (1 + 1e-5) + 1e-6).all()
    relative = (got - exact).norm() / exact.norm()
    assert relative < 0.02  # what this costs on Gaussian data: about 1 %


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantize_blocks_keeps_each_weight_within_half_a_step(dtype):
    _, w, _ = _data(131, 201, dtype)
    codes, scales = quantize_blocks(w)
    assert codes.dtype == torch.int8 and codes.abs().max() <= 127
    assert scales.dtype == torch.float16 and scales.shape == (131, 7)
    assert (codes[:, 201:] == 0).all()  # K padded to a whole block with zero codes
    assert scales[0, 0] == 0 and (codes[0, :32] == 0).all()  # the all-zero block
    # codes are rounded at the float32 step d = absmax / 127, the scale stored is float16(d)
    padded = torch.zeros(131, 224)
    padded[:, :201] = w.float()
    d = (padded.view(131, 7, 32).abs().amax(dim=2) / 127).repeat_interleave(BLOCK, dim=1)
    step = scales.float().repeat_interleave(BLOCK, dim=1)
    err = (padded - codes.float() * step).abs()
    assert (err <= d / 2 + 127 * (d - step).abs() + 1e-12).all()


def test_quantize_blocks_gives_the_codes_and_scales_of_a_gguf_q8_0_tensor():
    """Against the gguf package's Q8_0 quantizer, a numpy port of llama.cpp's reference one (it
    divides by d where llama.cpp multiplies by 1 / d, which can move a rare code by one; it moves
    none here)."""
    _, w, _ = _data(64, 256, torch.float32)
    raw = gguf.quants.quantize(w.numpy(), gguf.GGMLQuantizationType.Q8_0)
    blocks = torch.from_numpy(raw.reshape(64, 8, 34).copy())
    want_scales = blocks[:, :, :2].contiguous().view(torch.float16).view(64, 8)
    want_codes = blocks[:, :, 2:].contiguous().view(torch.int8).reshape(64, 256)
    codes, scales = quantize_blocks(w)
    assert torch.equal(scales, want_scales)
    assert torch.equal(codes, want_codes)


@pytest.mark.parametrize("bits", [8, 4, 5, 6])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,k", SHAPES)
def test_a_row_gets_the_same_bits_with_any_rows_beside_it(n, k, dtype, bits):
    x, w, b = _data(n, k, dtype)
    packed, _ = packed_weight(w, bits)
    alone = torch.cat([block_int8_linear(x[i : i + 1], packed, b) for i in range(x.shape[0])])
    for m in ROWS:
        for start in (0, 300 - m):
            got = block_int8_linear(x[start : start + m], packed, b)
            assert torch.equal(got, alone[start : start + m]), (m, start)


def test_the_thread_count_changes_no_bit():
    x, w, b = _data(960, 576, torch.float32)
    packed = pack_blocks(*quantize_blocks(w), 576)
    threads = torch.get_num_threads()
    try:
        results = []
        for t in (1, 2, 3):
            torch.set_num_threads(t)
            results.append((block_int8_linear(x, packed, b), block_int8_linear(x[:1], packed, b)))
    finally:
        torch.set_num_threads(threads)
    for many, one in results[1:]:
        assert torch.equal(many, results[0][0]) and torch.equal(one, results[0][1])


@pytest.mark.parametrize("bits", [8, 4, 5, 6])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_read_back_from_the_packed_matrix_are_the_dequantized_weight(dtype, bits):
    _, w, _ = _data(131, 201, torch.float32)
    packed, values = packed_weight(w, bits)
    ids = torch.tensor([[0, 130, 17], [16, 15, 64]])
    got = block_int8_rows(packed, ids, dtype)
    assert got.shape == (2, 3, 201) and got.dtype == dtype
    assert torch.equal(got, values[ids.reshape(-1)].to(dtype).view(2, 3, 201))
    with pytest.raises(IndexError):
        block_int8_rows(packed, torch.tensor([131]), dtype)


@pytest.mark.parametrize(
    "flags,paths",
    [
        ("-DSLUICE_NO_VNNI", ("avx2", "portable")),
        ("-DSLUICE_NO_VNNI -DSLUICE_NO_AVX2", ("portable",)),
    ],
    ids=["avx2-where-present", "portable"],
)
def test_builds_without_the_faster_instructions_give_the_same_bits(monkeypatch, flags, paths):
    wanted = {
        (shape, dtype, fn): fn(*shape, dtype, rows=40)
        for shape in SHAPES
        for dtype in (torch.float32, torch.bfloat16)
        for fn in (check, check_q4, check_q5, check_q6)
    }
    # the build is kept beside the normal one (the cache is keyed by the flags): built once per
    # version of the sources, as the normal one is
    monkeypatch.setattr(cpu_kernels, "_state", {})
    monkeypatch.setenv("SLUICE_NATIVE_CFLAGS", flags)
    assert cpu_kernels.library() is not None, cpu_kernels.unavailable_reason()
    assert dot_path() in paths
    for (shape, dtype, fn), want in wanted.items():
        assert torch.equal(fn(*shape, dtype, rows=40), want), (shape, dtype, fn.__name__)


def test_rejects_mismatched_operands():
    codes, scales = quantize_blocks(torch.ones(3, 8))
    packed = pack_blocks(codes, scales, 8)
    with pytest.raises(ValueError, match="8 columns"):
        block_int8_linear(torch.zeros(2, 9), packed)
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        block_int8_linear(torch.zeros(2, 8, dtype=torch.float64), packed)
    with pytest.raises(ValueError, match="bias"):
        block_int8_linear(torch.zeros(2, 8), packed, torch.zeros(4))
    with pytest.raises(ValueError, match="codes"):
        pack_blocks(codes[:, :8], scales, 8)
    with pytest.raises(ValueError, match="scales"):
        pack_blocks(codes, scales.float(), 8)
    assert block_int8_linear(torch.zeros(0, 8), packed).shape == (0, 3)
    codes4, d, m = quantize_q4_blocks(torch.ones(3, 8))
    with pytest.raises(ValueError, match="codes"):
        pack_q4_blocks(codes4.to(torch.int8), d, m, 8)
    with pytest.raises(ValueError, match="m: float16"):
        pack_q4_blocks(codes4, d, m.float(), 8)
    with pytest.raises(ValueError, match="d: float16"):
        pack_q5_blocks(codes4, d.float(), m, 8)
    codes6, d6, sc6 = q6_operands(3, 8)
    with pytest.raises(ValueError, match="sc: int8"):
        pack_q6_blocks(codes6, d6, sc6[:, :1], 8)
    with pytest.raises(ValueError, match="codes"):
        pack_q6_blocks(codes6.to(torch.int8), d6, sc6, 8)


@pytest.mark.parametrize("bits", [8, 4, 5, 6])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,k", SHAPES)
def test_a_widened_weight_is_the_dequantized_weight(n, k, dtype, bits):
    """What a large step multiplies with oneDNN instead (`NativeOps`, `widen_probe`): every value
    its codes stand for, bfloat16 rounded once."""
    _, w, _ = _data(n, k, torch.float32)
    packed, want = packed_weight(w, bits)
    got = widen_blocks(packed, dtype)
    assert got.shape == (n, k) and got.dtype == dtype
    assert torch.equal(got, want.to(dtype))


def test_a_matrix_quantized_a_slice_of_rows_at_a_time_gets_the_codes_of_it_whole(monkeypatch):
    # (a vocabulary matrix is quantized in slices, to bound the start's memory)
    from sluice.engine.cpu_kernels import block_int8_linear as blocks
    from sluice.engine.kernels import int8_linear

    weight = torch.randn(45, 70, generator=torch.Generator().manual_seed(3))
    quantizers = (quantize_blocks, quantize_q4_blocks, int8_linear.quantize_int8)
    whole = [quantize(weight) for quantize in quantizers]
    monkeypatch.setattr(blocks, "ROWS_AT_A_TIME", 8)
    monkeypatch.setattr(int8_linear, "ROWS_AT_A_TIME", 8)
    sliced = [quantize(weight) for quantize in quantizers]
    for a, b in zip(whole, sliced):
        assert all(torch.equal(x, y) for x, y in zip(a, b))
