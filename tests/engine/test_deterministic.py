"""Deterministic mode on the real default model (SmolLM2-135M, float32, bfloat16, and float32
activations on int8 and on 4-bit weights): the same request and seed give the same token ids and
logprobs, bit for bit, alone and inside a batch of 31 random others arriving at random steps, at
token budgets 64, 512 and 2048 (other chunked-prefill splits), with its prefix cached by another
request's batch, with 1 and 2 threads, in a second process, and resumed after its first tokens.
The Thinking Machines check: one prompt sampled at temperature 1 with one seed 200 times in varied
batches gives one completion.

Each test isolates its prefix cache with a cache salt of its own (the salt changes block hashes,
never numerics), so "alone" means computed from scratch."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from dataclasses import dataclass

import pytest
import torch

from sluice.engine.config import EngineConfig
from sluice.engine.engine import LLMEngine
from sluice.engine.errors import ConfigError
from sluice.engine.sampling_params import SamplingParams

PROMPT = (
    "Write a short poem about the sea and the wind, in the voice of an old lighthouse keeper who "
    "has watched the same stretch of coast for forty years, and who remembers every storm, every "
    "ship that passed, and the names of the gulls that nested on the rocks below his window."
)
TARGET = SamplingParams(
    temperature=1.0, top_p=0.95, seed=1234, max_tokens=20, logprobs=3, ignore_eos=True
)
WORDS = "alpha river stone cloud seven blue sings under the old bridge while rain falls".split()


@dataclass(frozen=True)
class Run:
    """What a request produced: token ids, and each position's logprob and top alternatives."""

    token_ids: tuple[int, ...]
    logprobs: tuple[tuple[float, tuple[tuple[int, float], ...]], ...]
    cached_tokens: int


# a variant's name -> its engine settings
VARIANTS = {
    "float32": {"dtype": "float32"},
    "bfloat16": {"dtype": "bfloat16"},
    "int8": {"dtype": "float32", "quantization": "int8"},
    "int4": {"dtype": "float32", "quantization": "int4"},
}


def make_engine(variant: str, **config) -> LLMEngine:
    return LLMEngine(
        config=EngineConfig(
            kv_cache_bytes=512 << 20, deterministic=True, **VARIANTS[variant], **config
        )
    )


def serve(engine: LLMEngine, arrivals: dict[int, list[tuple]], salt: str) -> dict[str, Run]:
    """Step the engine; before step s, add the requests arrivals[s] (request id, prompt token
    ids, params[, more add_request arguments]). Returns every request's run."""
    tokens: dict[str, list[int]] = {}
    logprobs: dict[str, list] = {}
    cached: dict[str, int] = {}
    step = 0
    while step <= max(arrivals) or engine.has_unfinished():
        for rid, ids, params, *more in arrivals.get(step, []):
            kwargs = more[0] if more else {}
            engine.add_request(rid, params=params, prompt_token_ids=ids, cache_salt=salt, **kwargs)
            tokens[rid], logprobs[rid] = [], []
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
            logprobs[out.request_id] += [(lp.logprob, tuple(lp.top)) for lp in out.logprobs]
            if out.finished:
                assert out.finish_reason in ("stop", "length"), out.error
                cached[out.request_id] = out.usage.cached_tokens
        step += 1
    return {rid: Run(tuple(tokens[rid]), tuple(logprobs[rid]), cached[rid]) for rid in tokens}


def random_mates(rng: random.Random, n: int, vocab: list[int], prefix: str) -> list[tuple]:
    """n requests of random prompts (3-200 tokens) and random sampling, some greedy."""
    mates = []
    for i in range(n):
        ids = [rng.choice(vocab) for _ in range(rng.randint(3, 200))]
        params = SamplingParams(
            temperature=rng.choice([0.0, 0.7, 1.0, 1.3]),
            top_k=rng.choice([0, 5, 50]),
            max_tokens=rng.randint(1, 20),
            seed=rng.randrange(1 << 30),
            ignore_eos=True,
        )
        mates.append((f"{prefix}-{i}", ids, params))
    return mates


@pytest.fixture(scope="module", params=list(VARIANTS))
def dtype(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def engine(dtype) -> LLMEngine:
    return make_engine(dtype)


@pytest.fixture(scope="module")
def prompt_ids(engine) -> list[int]:
    return engine.tokenizer.encode(PROMPT)


@pytest.fixture(scope="module")
def vocab(engine) -> list[int]:
    return sorted(set(engine.tokenizer.encode(" ".join(WORDS))))


@pytest.fixture(scope="module")
def alone(engine, prompt_ids) -> Run:
    return serve(engine, {0: [("target", prompt_ids, TARGET)]}, "alone")["target"]


def test_the_run_alone_is_what_the_others_are_compared_with(alone):
    assert len(alone.token_ids) == TARGET.max_tokens and len(alone.logprobs) == TARGET.max_tokens
    assert alone.cached_tokens == 0


def test_inside_a_batch_of_31_random_others_arriving_at_random_steps(
    engine, prompt_ids, vocab, alone
):
    rng = random.Random(63)
    arrivals: dict[int, list[tuple]] = {}
    for mate in random_mates(rng, 31, vocab, "mate"):
        arrivals.setdefault(rng.randint(0, 12), []).append(mate)
    at = rng.randint(1, 8)
    arrivals.setdefault(at, []).insert(
        rng.randint(0, len(arrivals.get(at, []))), ("target", prompt_ids, TARGET)
    )
    runs = serve(engine, arrivals, "batch-31")
    assert runs["target"] == alone


@pytest.mark.parametrize("budget", [64, 512, 2048])
def test_every_token_budget_gives_the_same_bits(dtype, prompt_ids, vocab, alone, budget):
    engine = make_engine(dtype, max_num_batched_tokens=budget)
    rng = random.Random(budget)
    arrivals = {0: random_mates(rng, 5, vocab, "a") + [("target", prompt_ids, TARGET)]}
    arrivals[3] = random_mates(rng, 5, vocab, "b")
    assert serve(engine, arrivals, f"budget-{budget}")["target"] == alone


def test_a_prefix_cached_by_another_requests_batch_gives_the_same_bits(
    engine, prompt_ids, vocab, alone
):
    rng = random.Random(5)
    primer = ("primer", prompt_ids + prompt_ids[:9], SamplingParams(temperature=0, max_tokens=3))
    serve(engine, {0: random_mates(rng, 6, vocab, "m") + [primer]}, "warm")
    run = serve(
        engine, {0: random_mates(rng, 3, vocab, "n") + [("target", prompt_ids, TARGET)]}, "warm"
    )["target"]
    assert run.cached_tokens >= 16
    assert (run.token_ids, run.logprobs) == (alone.token_ids, alone.logprobs)


def test_one_thread_gives_the_same_bits_as_two(engine, prompt_ids, alone):
    threads = torch.get_num_threads()
    torch.set_num_threads(1 if threads > 1 else 2)
    try:
        run = serve(engine, {0: [("target", prompt_ids, TARGET)]}, "threads")["target"]
    finally:
        torch.set_num_threads(threads)
    assert run == alone


SECOND_PROCESS = """
import json, sys
from sluice.engine.config import EngineConfig
from sluice.engine.engine import LLMEngine
from sluice.engine.sampling_params import SamplingParams
ids, params, variant = json.loads(sys.argv[1])
engine = LLMEngine(config=EngineConfig(kv_cache_bytes=256 << 20, deterministic=True, **variant))
result = engine.generate(prompt_token_ids=[ids], params=SamplingParams(**params))[0]
lps = [[lp.logprob.hex(), [[t, v.hex()] for t, v in lp.top]] for lp in result.samples[0].logprobs]
print(json.dumps({"token_ids": result.token_ids, "logprobs": lps}))
"""


def test_a_second_process_gives_the_same_bits(dtype, prompt_ids, alone):
    params = {
        k: getattr(TARGET, k)
        for k in ("temperature", "top_p", "seed", "max_tokens", "logprobs", "ignore_eos")
    }
    done = subprocess.run(
        [sys.executable, "-c", SECOND_PROCESS, json.dumps([prompt_ids, params, VARIANTS[dtype]])],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},  # and another thread count
    )
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert tuple(got["token_ids"]) == alone.token_ids
    want = [[lp.hex(), [[t, v.hex()] for t, v in top]] for lp, top in alone.logprobs]
    assert got["logprobs"] == want


@pytest.mark.parametrize("cut", [1, 9])
def test_a_resumed_request_continues_with_the_same_bits(engine, prompt_ids, vocab, alone, cut):
    """The pipeline's resume after a crash: the prompt and the published tokens are prefilled
    together, and what follows matches the uninterrupted run, logprobs included."""
    resumed = ("resumed", prompt_ids, TARGET, {"resume": {0: list(alone.token_ids[:cut])}})
    arrivals = {0: random_mates(random.Random(cut), 4, vocab, "r") + [resumed]}
    run = serve(engine, arrivals, f"resume-{cut}")["resumed"]
    assert run.token_ids == alone.token_ids[cut:] and run.logprobs == alone.logprobs[cut:]


def test_200_samples_of_one_seed_in_varied_batches_give_one_completion(engine, vocab):
    """Thinking Machines' check (temperature 1, one seed, 200 times), in batches of 1 to 40 copies
    among random others."""
    ids = engine.tokenizer.encode("Tell me about Richard Feynman.")
    params = SamplingParams(temperature=1.0, seed=42, max_tokens=8, ignore_eos=True)
    rng = random.Random(200)
    completions, made = set(), 0
    while made < 200:
        copies = min(200 - made, rng.choice([1, 7, 23, 40]))
        batch = [(f"tm-{made + i}", ids, params) for i in range(copies)]
        batch += random_mates(rng, rng.randint(0, 12), vocab, f"o{made}")
        rng.shuffle(batch)
        runs = serve(engine, {0: batch}, f"tm-{made}")
        completions |= {runs[f"tm-{made + i}"].token_ids for i in range(copies)}
        made += copies
    assert len(completions) == 1


def test_settings_deterministic_mode_cannot_honour_are_refused_by_field():
    for kv in ("int8", "fp8"):
        with pytest.raises(ConfigError) as err:
            EngineConfig(deterministic=True, kv_cache_dtype=kv)
        assert err.value.field == "kv_cache_dtype"
    with pytest.raises(ConfigError) as err:
        LLMEngine(config=EngineConfig(deterministic=True, kernels="torch"))
    assert err.value.field == "kernels"
