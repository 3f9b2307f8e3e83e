"""Decode steps replayed from static buffers (`captured_decode`, `EngineConfig.cuda_graphs`) give
the eager triton path's greedy tokens, and their padding rows touch nothing in the KV cache.

On CUDA the graphs are captured for real; on the CPU, where there is nothing to capture, the same
static buffers, padding and plan run eagerly (`capture=False`) under Triton's interpreter."""

from __future__ import annotations

import pytest
import torch
from _hf_models import build
from test_engine_kernels import DEVICE, engine, greedy, prompts

from sluice.engine.captured_decode import CapturedDecode, decode_buckets
from sluice.engine.config import EngineConfig
from sluice.engine.errors import ConfigError
from sluice.engine.forward import CapturedGraphs, StepInputs
from sluice.engine.sampling_params import SamplingParams


def captured_engine(path, **config):
    """A triton engine whose decode steps replay: captured graphs on CUDA, eager on the CPU."""
    if DEVICE == "cuda":
        return engine(path, "triton", cuda_graphs=True, **config)
    e = engine(path, "triton", **config)
    runner = e.runner
    captured = CapturedDecode(
        runner.model,
        runner.attention,
        runner.kv_caches,
        e.config.max_num_seqs,
        e.max_model_len,
        capture=False,
    )
    runner.route = CapturedGraphs(
        runner.model, runner.attention, runner.kv_caches, runner.embed, captured
    )
    return e


def captured_of(e) -> CapturedDecode:
    """The engine's captured decode steps (its route must be `CapturedGraphs`)."""
    assert isinstance(e.runner.route, CapturedGraphs), e.runner.route
    return e.runner.route.captured


@pytest.mark.parametrize(
    "quant",
    [{}, {"quantization": "int8"}, {"kv_cache_dtype": "int8"}],
    ids=["plain", "int8", "kv-int8"],
)
def test_replayed_decode_steps_give_the_eager_steps_greedy_tokens(tmp_path, quant):
    build("llama").save_pretrained(tmp_path)
    eager, replayed = engine(tmp_path, "triton", **quant), captured_engine(tmp_path, **quant)
    ps = prompts(eager.model_config.vocab_size)
    # requests that stop at different lengths leave decode steps of 6, 5, ..., 1 sequences: most
    # pad up to a bucket
    lengths = [2, 3, 4, 5, 6, 7]

    def run(e):
        params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths]
        return [r.token_ids for r in e.generate(prompt_token_ids=ps, params=params)]

    assert run(replayed) == run(eager)
    assert captured_of(replayed).replays > 0


def test_padding_rows_write_nothing_and_real_rows_match_the_eager_step(tmp_path):
    build("llama").save_pretrained(tmp_path)
    e = captured_engine(tmp_path)
    runner, captured = e.runner, captured_of(e)
    g = torch.Generator().manual_seed(5)
    for cache in runner.kv_caches:
        for t in (cache.k, cache.v):
            t.copy_(torch.randn(t.shape, generator=g).to(t.dtype))
    bs = runner.block_size
    # three decodes (a bucket of 4: one padding row); block 0 holds no sequence's context
    seq_lens = [5, 9, 13]
    tables = [[1, 2], [3, 4, 5], [6, 7, 8, 9]]
    tokens = torch.randint(3, e.model_config.vocab_size, (3,), generator=g).tolist()
    start = [(c.k.clone(), c.v.clone()) for c in runner.kv_caches]

    got = captured.logits(tokens, seq_lens, tables)
    after_replay = [(c.k.clone(), c.v.clone()) for c in runner.kv_caches]
    for cache, (k, v) in zip(runner.kv_caches, start):
        cache.k.copy_(k)
        cache.v.copy_(v)
    hidden = runner.forward(StepInputs(tokens, [1, 1, 1], seq_lens, tables, []))
    want = runner.model.compute_logits(hidden)

    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    written = torch.zeros(runner.kv_caches[0].k.shape[0] * bs, dtype=torch.bool, device=DEVICE)
    for n, table in zip(seq_lens, tables):
        written[table[(n - 1) // bs] * bs + (n - 1) % bs] = True
    for cache, (k0, v0), (k1, v1) in zip(runner.kv_caches, start, after_replay):
        for before, replayed, eager in ((k0, k1, cache.k), (v0, v1, cache.v)):
            # [blocks, Hkv, bs, D] -> [slots, Hkv, D]
            def slots(t):
                return t.transpose(1, 2).reshape(-1, *t.shape[1:2], t.shape[-1])

            assert torch.equal(slots(replayed)[~written], slots(before)[~written])
            torch.testing.assert_close(
                slots(replayed)[written], slots(eager)[written], rtol=1e-4, atol=1e-4
            )


def test_steps_larger_than_every_bucket_run_eagerly(tmp_path):
    build("llama").save_pretrained(tmp_path)
    e = captured_engine(tmp_path, max_num_seqs=2)
    captured = captured_of(e)
    assert captured.buckets == [1, 2]
    assert captured.logits([5, 6, 7], [1, 1, 1], [[1], [2], [3]]) is None
    ps = prompts(e.model_config.vocab_size)[:3]
    assert greedy(e, ps) == greedy(engine(tmp_path, "triton", max_num_seqs=2), ps)


def test_every_batch_size_has_a_bucket_with_little_padding():
    for max_seqs in (1, 3, 64, 100, 256, 1024):
        buckets = decode_buckets(max_seqs)
        assert buckets == sorted(set(buckets)) and buckets[-1] == min(max_seqs, 256)
        for n in range(1, buckets[-1] + 1):
            bucket = next(b for b in buckets if b >= n)
            assert bucket - n <= (7 if bucket <= 64 else bucket // 3), (max_seqs, n, bucket)


def test_cuda_graphs_off_cuda_or_with_tensor_parallel_ranks_is_a_clear_error():
    with pytest.raises(ConfigError, match="CUDA device") as e:
        EngineConfig(device="cpu", cuda_graphs=True)
    assert e.value.field == "cuda_graphs"
    with pytest.raises(ConfigError, match="tensor_parallel_size") as e:
        EngineConfig(device="cuda", cuda_graphs=True, tensor_parallel_size=2)
    assert e.value.field == "cuda_graphs"
    EngineConfig(device="auto", cuda_graphs=True)  # decided once the device is known
