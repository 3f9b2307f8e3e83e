"""A GGUF tensor read as int8 blocks by the native code (`cpu_kernels.gguf_to_blocks`): the file's
own codes for the types that hold int8 blocks (their values exactly those of the float64
reference decoders of test_gguf_loader), and for the others the very bits the Python path gives
(numpy's decoding, then `quantize_blocks`), so a start that skips that path changes no output."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from test_gguf_loader import _raw_tensor, reference_dequantize

from sluice.engine.cpu_kernels.block_int8_linear import (
    dequantize_blocks,
    dequantize_q4_blocks,
    dequantize_q6_blocks,
    quantize_blocks,
)
from sluice.engine.cpu_kernels.gguf_to_blocks import (
    gguf_int4_blocks,
    gguf_int8_blocks,
    gguf_q5_blocks,
    gguf_q6_blocks,
)
from sluice.engine.loader.gguf_blocks import int4_blocks

SHAPE = (6, 512)


def _raw(qtype: Q, seed: int = 0) -> np.ndarray:
    raw, _ = _raw_tensor(qtype, SHAPE, np.random.default_rng(seed))
    return np.ascontiguousarray(raw).view(np.uint8).reshape(-1)


@pytest.mark.parametrize("name", ["Q8_0", "Q5_0"])
def test_types_holding_int8_blocks_keep_their_codes(name):
    raw = _raw(Q[name])
    codes, scales = gguf_int8_blocks(raw, name, SHAPE)
    assert codes.dtype == torch.int8 and codes.shape == SHAPE
    assert scales.dtype == torch.float16 and scales.shape == (SHAPE[0], SHAPE[1] // 32)
    low = -127 if name == "Q8_0" else -16
    high = 127 if name == "Q8_0" else 15
    assert int(codes.min()) >= low and int(codes.max()) <= high
    got = codes.double().view(SHAPE[0], -1, 32) * scales.double().unsqueeze(2)
    want = reference_dequantize(raw, Q[name], SHAPE)
    assert np.array_equal(got.view(SHAPE).numpy(), want)


@pytest.mark.parametrize("name", ["Q4_0", "Q4_1", "Q4_K", "Q6_K"])
def test_other_types_are_quantized_again_with_the_python_paths_bits(name):
    raw = _raw(Q[name], seed=3)
    codes, scales = gguf_int8_blocks(raw, name, SHAPE)
    values = np.asarray(gguf.quants.dequantize(raw, Q[name]), dtype=np.float32).reshape(SHAPE)
    want_codes, want_scales = quantize_blocks(torch.from_numpy(values))
    assert torch.equal(codes, want_codes) and torch.equal(scales, want_scales)
    # and so within half an int8 step (and the step's float16 rounding) of the file's values
    exact = reference_dequantize(raw, Q[name], SHAPE)
    got = dequantize_blocks(codes, scales, SHAPE[1]).double().numpy()
    step = np.repeat(np.abs(exact).reshape(SHAPE[0], -1, 32).max(axis=2) / 127, 32, axis=1)
    assert (np.abs(got - exact) <= step * (0.5 + 127 * 2**-11) + 1e-12).all()


@pytest.mark.parametrize("name", ["Q4_0", "Q4_1", "Q4_K"])
def test_4_bit_types_give_the_blocks_numpy_reads(name):
    """The native reading of a 4-bit tensor's own blocks (what int4 weights are built from) is
    the numpy one's, tensor for tensor (which test_gguf_loader checks against the float64
    decoders)."""
    raw = _raw(Q[name], seed=5)
    got = gguf_int4_blocks(raw, name, SHAPE)
    want = int4_blocks(raw, name, SHAPE)
    for mine, theirs in zip(got, (want.codes, want.d, want.m)):
        assert mine.dtype == theirs.dtype and torch.equal(mine, theirs)


def test_q6_k_blocks_are_read_as_stored():
    """A Q6_K tensor's own codes, scales and d (what the 6-bit kernel multiplies): the values they
    stand for are the float64 reference decoder's exactly, and a super-block whose d is 0 reads as
    zeros."""
    raw = _raw(Q.Q6_K, seed=6)
    raw.reshape(-1, 210)[1, 208:210] = 0
    codes, d, sc = gguf_q6_blocks(raw, SHAPE)
    assert codes.dtype == torch.uint8 and codes.shape == SHAPE and int(codes.max()) <= 63
    assert d.dtype == torch.float16 and d.shape == (SHAPE[0], SHAPE[1] // 32)
    assert sc.dtype == torch.int8 and sc.shape == (SHAPE[0], SHAPE[1] // 16)
    assert (d.view(SHAPE[0], -1, 8) == d.view(SHAPE[0], -1, 8)[..., :1]).all()  # one d per 256
    got = dequantize_q6_blocks(codes, d, sc, SHAPE[1]).double().numpy()
    assert np.array_equal(got, reference_dequantize(raw, Q.Q6_K, SHAPE))
    assert not got[0, 256:512].any()
    with pytest.raises(ValueError, match="Q6_K blocks"):
        gguf_q6_blocks(np.zeros(5 * 210, np.uint8), (5, 288))
    with pytest.raises(ValueError, match="bytes"):
        gguf_q6_blocks(raw[:-210], SHAPE)


@pytest.mark.parametrize("name", ["Q5_0", "Q5_1", "Q5_K"])
def test_5_bit_blocks_are_read_as_stored(name):
    """A 5-bit tensor's own codes with each block's d and m (what the 5-bit kernel multiplies):
    the float64 reference decoder's values exactly for Q5_0 (m = -16 d) and Q5_1, and for Q5_K
    within float16 rounding of each block's d sc and dmin mn (products), as Q4_K's."""
    raw = _raw(Q[name], seed=8)
    codes, d, m = gguf_q5_blocks(raw, name, SHAPE)
    assert codes.dtype == torch.uint8 and codes.shape == SHAPE and int(codes.max()) == 31
    assert d.dtype == m.dtype == torch.float16 and d.shape == m.shape == (SHAPE[0], SHAPE[1] // 32)
    got = dequantize_q4_blocks(codes, d, m, SHAPE[1]).double().numpy()
    exact = reference_dequantize(raw, Q[name], SHAPE)
    if name == "Q5_K":
        step = np.repeat((31 * d.double().abs() + m.double().abs()).numpy(), 32, axis=1)
        assert (np.abs(got - exact) <= step * 2**-11 + 1e-6 * np.abs(exact).max()).all()
    else:
        assert np.array_equal(got, exact)
    with pytest.raises(ValueError, match="Q4_K"):
        gguf_q5_blocks(_raw(Q.Q4_K), "Q4_K", SHAPE)
    with pytest.raises(ValueError, match="bytes"):
        gguf_q5_blocks(raw[:-1], name, SHAPE)


def test_a_zero_block_and_tiny_scales():
    """An all-zero block gets scale 0 and zero codes; subnormal float16 scales decode exactly."""
    blocks = np.zeros((SHAPE[0] * SHAPE[1] // 32, 34), dtype=np.uint8)
    d = np.full(len(blocks), 2.0**-20, dtype=np.float16)  # a float16 subnormal
    d[0] = 0
    blocks[:, 0:2] = d.view(np.uint8).reshape(-1, 2)
    blocks[:, 2:] = (
        np.random.default_rng(4)
        .integers(-127, 128, (len(blocks), 32))
        .astype(np.int8)
        .view(np.uint8)
    )
    codes, scales = gguf_int8_blocks(blocks.reshape(-1), "Q8_0", SHAPE)
    assert float(scales[0, 0]) == 0.0
    assert float(scales[0, 1]) == 2.0**-20
    raw = _raw(Q.Q6_K)
    raw.reshape(-1, 210)[0, 208:210] = 0  # a super-block whose d is 0: its blocks are zeros
    codes, scales = gguf_int8_blocks(raw, "Q6_K", SHAPE)
    assert not codes[0, :256].any() and not scales[0, :8].any()


def test_types_and_shapes_it_does_not_read_are_refused():
    with pytest.raises(ValueError, match="Q5_1"):
        gguf_int8_blocks(_raw(Q.Q5_1), "Q5_1", SHAPE)
    with pytest.raises(ValueError, match="bytes"):
        gguf_int8_blocks(_raw(Q.Q8_0)[:-34], "Q8_0", SHAPE)
    with pytest.raises(ValueError, match="Q6_K blocks"):
        gguf_int8_blocks(np.zeros(5 * 210, np.uint8), "Q6_K", (5, 288))
    with pytest.raises(ValueError, match="Q8_0"):
        gguf_int4_blocks(_raw(Q.Q8_0), "Q8_0", SHAPE)
