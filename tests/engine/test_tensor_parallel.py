"""Tensor parallelism (`EngineConfig.tensor_parallel_size`, `sluice.engine.tensor_parallel`):
heads and MLP columns split over processes that talk through a real gloo group.

- the split itself against the unsharded model: two ranks in two threads of this process, each
  over its slices, give the unsharded logits (o_proj bias added once, Qwen2's qkv bias sharded);
- the engine at TP=2 (rank 0 here, a worker process) gives TP=1's greedy tokens: the default
  model in float32 (9 query / 3 KV heads: 6+3 and 2+1), a tiny Qwen2 (6 / 3 heads) plain, with
  int8 or int4 weights, with an int8 KV cache, with chunked prefill and a prefix-cache hit; and
  `sluice generate`;
- built in a helper thread of an asyncio program, as the pipeline builds it;
- a worker killed or hung is an error on rank 0, not a hang; workers die with rank 0 and with
  `close`; what is refused is refused at start, naming tensor_parallel_size.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from _hf_models import build, garbage_caches, make_prompts, rel_err, run_in_steps, shuffled_tables

from sluice.engine.config import EngineConfig, ModelConfig
from sluice.engine.engine import LLMEngine
from sluice.engine.errors import ConfigError, TensorParallelError
from sluice.engine.kernel_ops.torch_ops import TorchOps
from sluice.engine.loader import build_model, load_model
from sluice.engine.sampling_params import SamplingParams
from sluice.engine.tensor_parallel.group import TensorParallelGroup
from sluice.engine.tensor_parallel.sharding import ShardPlan

pytestmark = [
    pytest.mark.slow,  # processes start: a few seconds a test
    pytest.mark.skipif(not Path("/proc").is_dir(), reason="checks processes in /proc"),
]

# 6 query heads over 3 KV heads, head size 32: at TP=2, 2+1 KV heads and 4+2 query heads; MLP
# 352 columns = 11 runs of 32: 192 + 160
QWEN2 = dict(
    hidden_size=192,
    num_attention_heads=6,
    num_key_value_heads=3,
    head_dim=32,
    intermediate_size=352,
    max_position_embeddings=512,
    tie_word_embeddings=True,
)
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def alive(pid: int) -> bool:
    """The process exists and is not a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rpartition(")")[2].split()[0] != "Z"


def wait_gone(pids: list[int], within_s: float) -> list[int]:
    """The pids still alive after waiting up to `within_s`."""
    deadline = time.monotonic() + within_s
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return [p for p in pids if alive(p)]


@pytest.fixture(autouse=True)
def keep_torch_threads():
    threads = torch.get_num_threads()  # rank 0 takes its share of them
    yield
    torch.set_num_threads(threads)


# -- the split --------------------------------------------------------------------------------


def test_the_plan_deals_out_uneven_heads_and_columns():
    config = ModelConfig(
        "llama", 49152, 576, 1536, 30, 9, 3, 64, 1e-5, 1e5, None, 8192, True, False, 1, (2,)
    )
    plan = ShardPlan.of(config, 2)
    assert [(r.kv_heads, r.q_heads, r.columns) for r in plan.ranks] == [
        ((0, 2), (0, 6), (0, 768)),
        ((2, 3), (6, 9), (768, 1536)),
    ]
    three = ShardPlan.of(config, 3)
    assert [r.columns for r in three.ranks] == [(0, 512), (512, 1024), (1024, 1536)]
    odd = ShardPlan.of(ModelConfig(**{**config.__dict__, "intermediate_size": 352}), 2)
    assert [r.columns for r in odd.ranks] == [(0, 192), (192, 352)]  # in runs of 32
    with pytest.raises(ConfigError) as refused:
        ShardPlan.of(config, 4)
    assert refused.value.field == "tensor_parallel_size" and "3 KV heads" in str(refused.value)


def run_ranks(world_size: int, fn):
    """fn(group) on each rank of a real gloo group, the ranks in threads of this process."""
    store = torch.distributed.HashStore()
    results: list = [None] * world_size
    errors: list[BaseException] = []

    def rank(r: int) -> None:
        try:
            results[r] = fn(TensorParallelGroup(store, r, world_size, torch.device("cpu")))
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    if errors:
        raise errors[0]
    return results


@pytest.mark.parametrize(
    "kind,overrides",
    [
        ("qwen2", QWEN2),  # qkv bias sharded with its rows
        ("llama", {**QWEN2, "attention_bias": True}),  # o_proj bias: added once
        # QK-norm over each rank's heads, the attention output's norm after the all-reduce,
        # local layers between global ones
        (
            "gemma3",
            {
                **QWEN2,
                "num_hidden_layers": 4,
                "sliding_window": 5,
                "sliding_window_pattern": 2,
                "query_pre_attn_scalar": 24,
            },
        ),
    ],
    ids=["qwen2-qkv-bias", "llama-o-proj-bias", "gemma3-local-global"],
)
def test_sharded_ranks_give_the_unsharded_logits(tmp_path, kind, overrides):
    """Prompt logits through three steps (chunked prefill, then a decode) over a paged cache: the
    ranks' models, each with its slices and summing through the group's all-reduce, against the
    whole model."""
    build(kind, **overrides).save_pretrained(tmp_path)
    loaded = load_model(tmp_path, load_tokenizer=False)
    config, tensors = loaded.config, loaded.tensors
    whole = build_model(config, tensors, ops=TorchOps())
    prompts = make_prompts(config.vocab_size)
    tables = shuffled_tables([len(p) for p in prompts], 64)
    window = config.sliding_window
    want = run_in_steps(whole, prompts, tables, garbage_caches(config, 64), window)
    for world_size in (2, 3):
        plan = ShardPlan.of(config, world_size)

        def rank(group: TensorParallelGroup, plan=plan):
            part = plan.rank_config(group.rank)
            model = build_model(part, plan.rank_tensors(tensors, group.rank), ops=TorchOps())
            model.shard(group.all_reduce)
            return run_in_steps(model, prompts, tables, garbage_caches(part, 64), window)

        for got in run_ranks(world_size, rank):
            for g, w in zip(got, want):
                assert rel_err(g, w) < 1e-5


# -- the engine at TP=2 against TP=1 ------------------------------------------------------------

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea, there lived an old fisherman",
]
# shares its first block (16 tokens) with PROMPTS[2]: a prefix-cache hit in the second round
AGAIN = "Once upon a time, in a small village by the sea, there lived an old woman who"


def smollm2_round(tp: int) -> tuple[list[list[int]], list[int], int, list[int]]:
    """Greedy tokens of PROMPTS together in 8-token steps (chunked prefill), then of AGAIN with
    its cached tokens; and the engine's worker pids, gone after `close`."""
    engine = LLMEngine(
        config=EngineConfig(
            dtype="float32",
            kv_cache_bytes=64 << 20,
            max_num_batched_tokens=8,
            tensor_parallel_size=tp,
        )
    )
    try:
        pids = list(engine.runner.workers.pids) if tp > 1 else []
        first = [r.token_ids for r in engine.generate(PROMPTS, GREEDY)]
        (again,) = engine.generate(AGAIN, GREEDY)
        return first, again.token_ids, again.usage.cached_tokens, pids
    finally:
        engine.close()


@pytest.fixture(scope="module")
def smollm2_tp1():
    # with the threads of each TP=2 rank (one each on a 2-core machine): two threads on a busy
    # machine can be ten times slower
    threads = torch.get_num_threads()
    torch.set_num_threads(max(1, threads // 2))
    try:
        return smollm2_round(1)
    finally:
        torch.set_num_threads(threads)


def test_smollm2_at_tp2_gives_tp1s_greedy_tokens(smollm2_tp1):
    first, again, cached, pids = smollm2_round(2)
    assert (first, again) == smollm2_tp1[:2]
    assert cached >= 16 and cached == smollm2_tp1[2]
    assert len(pids) == 1 and wait_gone(pids, 5) == []  # close stopped the worker


def test_sluice_generate_at_tp2_gives_tp1s_greedy_tokens(smollm2_tp1):
    result = subprocess.run(
        [sys.executable, "-m", "sluice", "generate", "--json", "--dtype", "float32"]
        + ["--quantization", "none"]
        + ["--tensor-parallel-size", "2", "--max-num-batched-tokens", "8", "--kv-cache-mb", "64"]
        + ["--max-tokens", "8", "--ignore-eos", *PROMPTS],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    records = [json.loads(line) for line in result.stdout.splitlines()]
    assert [r["token_ids"] for r in records] == smollm2_tp1[0]
    assert "tensor parallel: 2 ranks over gloo" in result.stderr
    assert "rank 1: KV heads 2, query heads 6-8" in result.stderr


@pytest.fixture(scope="module")
def qwen2_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen2-tp")
    build("qwen2", **QWEN2).save_pretrained(path)
    return path


def tiny_engine(path, tp: int, **config) -> LLMEngine:
    defaults = dict(kv_cache_bytes=4 << 20, max_num_batched_tokens=12, tensor_parallel_size=tp)
    return LLMEngine(
        config=EngineConfig(**{**defaults, **config}), loaded=load_model(path, load_tokenizer=False)
    )


def tiny_prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    shared = torch.randint(3, vocab, (21,), generator=g).tolist()
    own = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (1, 6, 17, 40)]
    return own + [shared + [4, 5], shared + [7, 8, 9, 10, 11]]  # the last two share a block


# Greedy with the gap between the two most likely tokens at each step. Tensor parallelism adds the
# ranks' partial sums in another order: in float32 that moves a logit by ~1e-6, but where the
# activations are quantized per block (int8 and int4 weights) or the cache is, such a move can
# turn a code over and move a logit by ~1e-2 (on an AMD EPYC, int8 weights at TP=2 took the
# other of two tokens 0.0115 apart). Where the two most likely are closer than that, the rank
# group may take the other one and the text goes its own way from there.
GREEDY_GAPS = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2)
NEAR_TIE = {"float32": 1e-3, "quantized": 0.02}


def with_gaps(results) -> list[tuple[list[int], list[float]]]:
    """Each result's tokens, and at each the logprob gap between the two most likely."""
    return [
        (r.token_ids, [lp.top[0][1] - lp.top[1][1] for lp in r.samples[0].logprobs])
        for r in results
    ]


def same_until_a_near_tie(got, want, near_tie: float) -> int:
    """Asserts each of `got`'s texts is `want`'s up to `want`'s first gap under `near_tie`;
    returns how many tokens that compared."""
    compared = 0
    for (tokens, _), (reference, gaps) in zip(got, want, strict=True):
        n = next((i for i, gap in enumerate(gaps) if gap < near_tie), len(reference))
        assert tokens[:n] == reference[:n], (tokens, reference, gaps)
        compared += n
    return compared


@pytest.mark.parametrize(
    "config",
    [{}, {"quantization": "int8"}, {"quantization": "int4"}, {"kv_cache_dtype": "int8"}],
    ids=["float32", "int8-weights", "int4-weights", "int8-kv"],
)
def test_tiny_qwen2_at_tp2_gives_tp1s_greedy_tokens(qwen2_dir, config):
    results = {}
    for tp in (1, 2):
        engine = tiny_engine(qwen2_dir, tp, **config)
        try:
            ps = tiny_prompts(engine.model_config.vocab_size)
            first = engine.generate(prompt_token_ids=ps, params=GREEDY_GAPS)
            again = engine.generate(prompt_token_ids=ps[-2:], params=GREEDY_GAPS)
            assert all(r.usage.cached_tokens >= 16 for r in again)
            results[tp] = with_gaps(first), with_gaps(again)
        finally:
            engine.close()
    near_tie = NEAR_TIE["quantized" if config else "float32"]
    total = sum(len(tokens) for tokens, _ in results[1][0] + results[1][1])
    compared = same_until_a_near_tie(results[2][0], results[1][0], near_tie)
    compared += same_until_a_near_tie(results[2][1], results[1][1], near_tie)
    assert compared >= 2 / 3 * total, f"only {compared} of {total} tokens before a near-tie"


async def test_built_in_a_helper_thread_of_an_asyncio_program(qwen2_dir):
    """As the pipeline does: the engine built in a thread that ends once it is built
    (`in_passing_thread`), then stepped in another."""
    from sluice.actors.runtime.worker import in_passing_thread

    engine = await in_passing_thread(tiny_engine, qwen2_dir, 2)
    try:
        (pid,) = engine.runner.workers.pids
        await asyncio.sleep(0.5)  # the building thread is gone; its worker must not be
        assert alive(pid)
        ps = tiny_prompts(engine.model_config.vocab_size)[:2]

        def generate():
            return engine.generate(prompt_token_ids=ps, params=GREEDY)

        results = await in_passing_thread(generate)
        assert [len(r.token_ids) for r in results] == [8, 8]
    finally:
        engine.close()


# -- failures ---------------------------------------------------------------------------------


def test_a_killed_worker_is_an_error_on_rank_0(qwen2_dir):
    engine = tiny_engine(qwen2_dir, 3)
    try:
        ps = tiny_prompts(engine.model_config.vocab_size)[:2]
        engine.generate(prompt_token_ids=ps, params=GREEDY)
        victim, other = engine.runner.workers.pids
        os.kill(victim, signal.SIGKILL)
        started = time.monotonic()
        with pytest.raises(TensorParallelError, match=rf"rank 1 \(pid {victim}\) was killed by "):
            engine.generate(prompt_token_ids=ps, params=GREEDY)
        assert time.monotonic() - started < 10
        assert wait_gone([other], 5) == []  # the rest stopped with it
        with pytest.raises(TensorParallelError):  # and it stays an error, at once
            engine.step()
    finally:
        engine.close()


def test_a_hung_worker_is_an_error_after_the_collective_timeout(qwen2_dir, monkeypatch):
    monkeypatch.setenv("SLUICE_TP_TIMEOUT_S", "2")
    engine = tiny_engine(qwen2_dir, 2)
    try:
        (pid,) = engine.runner.workers.pids
        os.kill(pid, signal.SIGSTOP)
        started = time.monotonic()
        with pytest.raises(TensorParallelError, match="Timed out"):
            engine.generate(prompt_token_ids=[[5, 6, 7]], params=GREEDY)
        assert time.monotonic() - started < 10
        assert wait_gone([pid], 5) == []  # killed, stopped as it was
    finally:
        engine.close()


RANK_0 = """
import sys, time
from sluice.engine import EngineConfig, LLMEngine
from sluice.engine.loader import load_model
engine = LLMEngine(
    config=EngineConfig(kv_cache_bytes=4 << 20, tensor_parallel_size=3),
    loaded=load_model(sys.argv[1], load_tokenizer=False),
)
print(*engine.runner.workers.pids, flush=True)
time.sleep(600)
"""


def test_workers_die_with_rank_0(qwen2_dir):
    rank_0 = subprocess.Popen(
        [sys.executable, "-c", RANK_0, str(qwen2_dir)], stdout=subprocess.PIPE, text=True
    )
    try:
        pids = [int(p) for p in rank_0.stdout.readline().split()]
        assert len(pids) == 2 and all(alive(p) for p in pids)
        rank_0.kill()
        assert wait_gone(pids, 5) == []
    finally:
        rank_0.kill()
        rank_0.wait()


def test_refusals_name_the_field(qwen2_dir):
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ConfigError) as refused:
            EngineConfig(tensor_parallel_size=bad)
        assert refused.value.field == "tensor_parallel_size"
    with pytest.raises(ConfigError, match="deterministic") as refused:
        EngineConfig(tensor_parallel_size=2, deterministic=True)
    assert refused.value.field == "tensor_parallel_size"

    before = set(children())
    with pytest.raises(ConfigError, match="3 KV heads") as refused:
        tiny_engine(qwen2_dir, 4)  # more ranks than KV heads, found once the model is read
    assert refused.value.field == "tensor_parallel_size"
    assert wait_gone(sorted(set(children()) - before), 5) == []  # the started workers stopped


def children() -> list[int]:
    me = os.getpid()
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rpartition(")")[2].split()
        except OSError:
            continue
        if int(fields[1]) == me and fields[0] != "Z":
            out.append(int(stat.parent.name))
    return out


def test_kv_transfer_neither_exports_nor_adopts_a_split_cache(qwen2_dir):
    from sluice.engine.kv_transfer import export_prefix, import_prefix

    whole = tiny_engine(qwen2_dir, 1)
    ps = tiny_prompts(whole.model_config.vocab_size)[-2:]
    whole.generate(prompt_token_ids=ps, params=GREEDY)
    blocks = export_prefix(whole, ps[0], None)
    assert blocks is not None and blocks.num_tokens >= 16
    split = tiny_engine(qwen2_dir, 2)
    try:
        assert import_prefix(split, blocks) == 0
        split.generate(prompt_token_ids=ps, params=GREEDY)
        assert export_prefix(split, ps[0], None) is None
    finally:
        split.close()
