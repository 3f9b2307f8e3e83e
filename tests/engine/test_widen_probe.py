"""Quantized weights widened to bfloat16 for large steps (`widen_probe`, `NativeOps.linear`): the
probe widens a shape from the smallest row count at which widening won there and at every larger
count, never where it lost at the largest; it caches what it measured per machine and can be
overridden; a widened matmul is oneDNN's on the dequantized weight, exactly; an engine widens only
its steps of enough rows (the single native call for the layers gives way to them) and never in
float32 or deterministic mode.

The choice is checked on synthetic cases where the answer is known (one way made slower by a fixed
sleep); which way really is faster on this CPU is what the probe is for, so no test asserts it."""

from __future__ import annotations

import time

import pytest
import torch
import torch.nn.functional as F

from sluice.engine import widen_probe
from sluice.engine.config import EngineConfig
from sluice.engine.cpu_kernels import block_int8_linear as blocks
from sluice.engine.engine import LLMEngine
from sluice.engine.kernel_ops.native_ops import NativeOps
from sluice.engine.sampling_params import SamplingParams
from sluice.engine.weights import BlockInt8Linear, Linear

SHAPES = [(96, 64, blocks.FMT_Q8), (64, 160, blocks.FMT_Q4)]


def test_widening_starts_where_it_wins_at_that_and_every_larger_count():
    assert widen_probe.widen_from({64: (1.0, 2.0), 256: (4.0, 3.0), 1024: (16.0, 6.0)}) == 256
    assert widen_probe.widen_from({64: (1.0, 0.5), 256: (4.0, 3.0), 1024: (16.0, 6.0)}) == 64
    # a win at 64 rows but a loss at 256 counts only from 1024
    assert widen_probe.widen_from({64: (1.0, 0.5), 256: (4.0, 5.0), 1024: (16.0, 6.0)}) == 1024
    assert widen_probe.widen_from({64: (1.0, 0.5), 256: (4.0, 3.0), 1024: (6.0, 7.0)}) is None


# Far above what either way takes at these shapes (a millisecond or so), even on a loaded machine:
# with 3 ms the slowed widened way still won at 1024 rows on this project's 2-core AMD EPYC while
# other work ran.
def _slowed(way, delay: float = 0.03):
    def slow(x, packed):
        time.sleep(delay)
        return way(x, packed)

    return slow


@pytest.mark.parametrize("slow", ["as stored", "widened"])
def test_the_probe_widens_where_widening_is_faster(monkeypatch, tmp_path, slow):
    as_stored, widened = widen_probe.WAYS
    ways = (_slowed(as_stored), widened) if slow == "as stored" else (as_stored, _slowed(widened))
    monkeypatch.setattr(widen_probe, "WAYS", ways)
    monkeypatch.delenv(widen_probe.ENV, raising=False)
    choice = widen_probe.choose_widening(SHAPES, torch.bfloat16, cache_dir=tmp_path)
    assert choice.reason == "measured now"
    assert set(choice.ms) == {"96x64", "64x160"}
    if slow == "as stored":
        assert choice.rows == {(96, 64): 64, (64, 160): 64}
    else:
        assert choice.rows == {}
    # the next start reads what was measured, whatever the ways would take now
    monkeypatch.setattr(widen_probe, "WAYS", widen_probe.WAYS[::-1])
    again = widen_probe.choose_widening(SHAPES, torch.bfloat16, cache_dir=tmp_path)
    assert again.reason == "measured before on this machine" and again.rows == choice.rows


def test_float32_activations_and_the_environment_decide_without_measuring(monkeypatch, tmp_path):
    monkeypatch.setenv(widen_probe.ENV, "128")
    choice = widen_probe.choose_widening(SHAPES, torch.float32, cache_dir=tmp_path)
    assert choice.rows == {} and choice.ms == {}
    monkeypatch.setenv(widen_probe.ENV, "never")
    assert widen_probe.choose_widening(SHAPES, torch.bfloat16, cache_dir=tmp_path).rows == {}
    monkeypatch.setenv(widen_probe.ENV, "128")
    choice = widen_probe.choose_widening(SHAPES, torch.bfloat16, cache_dir=tmp_path)
    assert choice.rows == {(96, 64): 128, (64, 160): 128}
    assert not list(tmp_path.iterdir()), "nothing was measured, so nothing is cached"
    monkeypatch.setenv(widen_probe.ENV, "some")
    with pytest.raises(ValueError, match=widen_probe.ENV):
        widen_probe.choose_widening(SHAPES, torch.bfloat16, cache_dir=tmp_path)


@pytest.mark.parametrize("bits", [8, 4])
def test_a_widened_matmul_is_onednns_on_the_dequantized_weight(bits):
    g = torch.Generator().manual_seed(bits)
    weight, bias = torch.randn(80, 96, generator=g), torch.randn(80, generator=g)
    layer = BlockInt8Linear.quantize(Linear(weight, bias.bfloat16()), bits)
    dequantized = blocks.widen_blocks(layer.packed, torch.float32)
    ops = NativeOps()
    ops.widen_rows = {(80, 96): 4}
    small, large = (torch.randn(m, 96, generator=g).bfloat16() for m in (3, 4))
    assert torch.equal(
        ops.linear(small, layer), blocks.block_int8_linear(small, layer.packed, layer.bias)
    )
    want = F.linear(large, dequantized.bfloat16(), layer.bias)
    assert torch.equal(ops.linear(large, layer), want)
    # float32 activations stay on the kernel whatever the table says
    layer = BlockInt8Linear.quantize(Linear(weight, bias), bits)
    x = large.float()
    assert torch.equal(ops.linear(x, layer), blocks.block_int8_linear(x, layer.packed, bias))


def _widenings_per_step(monkeypatch, **config):
    """(rows of the step, widen calls in it) for each step of a 40-token prompt and 3 tokens."""
    calls = []
    widen = blocks.widen_blocks

    def counted(packed, dtype):
        calls.append(packed.n)
        return widen(packed, dtype)

    monkeypatch.setattr("sluice.engine.kernel_ops.native_ops.widen_blocks", counted)
    e = LLMEngine(config=EngineConfig(kv_cache_bytes=16 << 20, **config))
    e.add_request("r", prompt_token_ids=list(range(100, 140)), params=SamplingParams(max_tokens=3))
    steps = []
    while e.has_unfinished():
        before = len(calls)
        e.step()
        steps.append(len(calls) - before)
    return e, steps


def test_an_engine_widens_only_steps_with_enough_rows(monkeypatch):
    monkeypatch.setenv(widen_probe.ENV, "16")
    e, steps = _widenings_per_step(monkeypatch, quantization="int8", dtype="bfloat16")
    layers = e.model_config.num_hidden_layers
    assert set(e.ops.widen_rows.values()) == {16}
    # the prompt's step widens all four projections of every layer; the decode steps none
    assert steps == [4 * layers, 0, 0]
    # and every output says so
    c = e.model_config
    assert e.provenance.widened_from_rows[f"{c.intermediate_size * 2}x{c.hidden_size}"] == 16


@pytest.mark.parametrize(
    "config",
    [
        dict(quantization="int4", dtype="float32"),
        dict(quantization="int8", dtype="bfloat16", deterministic=True),
    ],
    ids=["float32", "deterministic"],
)
def test_no_widening_in_float32_or_deterministic_mode(monkeypatch, config):
    monkeypatch.setenv(widen_probe.ENV, "16")
    e, steps = _widenings_per_step(monkeypatch, **config)
    assert steps == [0, 0, 0]
    assert e.provenance.widened_from_rows is None
