"""Deterministic mode on the Triton kernels (its CUDA family; Triton's interpreter on the CPU
here): a request with a seed gives the same token ids and logprobs, bit for bit, alone, inside a
batch of others that arrive while it runs, at another token budget (its prompt split into other
chunks), and after another request cached its prefix; and greedy, the tokens of the torch
family. Tiny random-weight models (the interpreter is slow): a GQA Llama, and a Mistral whose
sliding window (24 tokens) is shorter than the prompt."""

from __future__ import annotations

import random

import pytest
import torch
from _hf_models import build

from sluice.engine.config import EngineConfig
from sluice.engine.engine import LLMEngine
from sluice.engine.errors import ConfigError
from sluice.engine.kernel_ops import resolve_kernel_ops
from sluice.engine.loader import load_model
from sluice.engine.sampling_params import SamplingParams

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
MODELS = {
    "llama-gqa": ("llama", {}),
    "mistral-window": ("mistral", {"sliding_window": 24}),
}
TARGET = SamplingParams(
    temperature=1.0, top_p=0.9, seed=77, max_tokens=10, logprobs=3, ignore_eos=True
)


def engine(path, **config) -> LLMEngine:
    defaults = dict(
        kv_cache_bytes=4 << 20,
        block_size=4,
        max_num_batched_tokens=64,
        device=DEVICE,
        kernels="triton",
        deterministic=True,
    )
    return LLMEngine(
        config=EngineConfig(**{**defaults, **config}), loaded=load_model(path, load_tokenizer=False)
    )


def run(e: LLMEngine, prompt: list[int], salt: str, mates: list[list[int]] = (), at: int = 0):
    """The target's token ids and logprobs; `mates` join after `at` steps."""
    e.add_request("target", prompt_token_ids=prompt, params=TARGET, cache_salt=salt)
    rng = random.Random(5)
    tokens, logprobs, step = [], [], 0
    while e.has_unfinished():
        if step == at:
            for i, m in enumerate(mates):
                params = SamplingParams(temperature=0.7, max_tokens=rng.randrange(3, 12), seed=i)
                e.add_request(f"mate-{i}", prompt_token_ids=m, params=params, cache_salt=salt)
        for out in e.step():
            if out.request_id == "target":
                tokens += out.new_token_ids
                logprobs += [(lp.logprob, tuple(lp.top)) for lp in out.logprobs or []]
        step += 1
    return tokens, logprobs


@pytest.fixture(scope="module", params=list(MODELS))
def model_dir(request, tmp_path_factory):
    kind, overrides = MODELS[request.param]
    path = tmp_path_factory.mktemp(request.param)
    build(kind, **overrides).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def prompt(model_dir) -> list[int]:
    vocab = load_model(model_dir, load_tokenizer=False).config.vocab_size
    return [(11 * j) % (vocab - 3) + 3 for j in range(37)]


@pytest.fixture(scope="module")
def alone(model_dir, prompt):
    e = engine(model_dir)
    assert e.kernels == "deterministic-triton"
    return run(e, prompt, "alone")


def test_alone_it_samples_and_reports_logprobs(alone):
    tokens, logprobs = alone
    assert len(tokens) == 10 and len(logprobs) == 10


def test_inside_a_batch_arriving_mid_run_and_at_other_budgets(model_dir, prompt, alone):
    g = torch.Generator().manual_seed(3)
    mates = [torch.randint(3, 90, (n,), generator=g).tolist() for n in (1, 9, 30)]
    # mates from the second step with room for whole prompts; mates joining a target already
    # decoding, every prompt split into chunks of 12
    for budget, at in ((64, 2), (12, 5)):
        e = engine(model_dir, max_num_batched_tokens=budget)
        assert run(e, prompt, f"batch-{budget}", mates, at) == alone, budget


def test_after_another_request_cached_its_prefix(model_dir, prompt, alone):
    e = engine(model_dir, max_num_batched_tokens=16)
    other = SamplingParams(temperature=0, max_tokens=2)
    e.generate(prompt_token_ids=[prompt[:29] + [5, 6]], params=other, cache_salt="cached")
    got = run(e, prompt, "cached")
    assert got == alone


def test_greedy_it_gives_the_torch_familys_tokens(model_dir, prompt):
    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    ps = [prompt, prompt[:5], prompt[3:30]]
    det = engine(model_dir).generate(prompt_token_ids=ps, params=greedy)
    torch_family = engine(model_dir, kernels="torch", deterministic=False)
    want = torch_family.generate(prompt_token_ids=ps, params=greedy)
    assert [r.token_ids for r in det] == [r.token_ids for r in want]


def test_what_it_cannot_honour_is_refused(model_dir):
    with pytest.raises(ConfigError) as e:
        engine(model_dir, quantization="int8")
    assert e.value.field == "quantization"
    with pytest.raises(ConfigError) as e:
        resolve_kernel_ops("torch", "cuda", deterministic=True)
    assert e.value.field == "kernels"
