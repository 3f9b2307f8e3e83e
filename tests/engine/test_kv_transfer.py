"""A prompt's KV computed by one engine and adopted by another: the adopting engine finds the
prompt's full blocks cached, holds bit-for-bit the KV the first engine computed, and generates
what an engine that computed everything itself generates. Blocks that do not fit are refused,
and adopting a chain never evicts a block of that chain."""

from __future__ import annotations

import pytest
import torch
from _hf_models import build

from sluice.engine import EngineConfig, LLMEngine, SamplingParams
from sluice.engine.block_manager import BlockManager, prefix_block_hashes
from sluice.engine.kv_transfer import export_prefix, import_prefix
from sluice.engine.loader import load_model

BLOCK = 4
PROMPTS = [[(5 * i + 3 * j) % 97 + 2 for j in range(n)] for i, n in enumerate((23, 40, 9))]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama")
    build("llama").save_pretrained(path)
    return path


def engine(model_dir, **overrides) -> LLMEngine:
    config = EngineConfig(kv_cache_bytes=2 << 20, block_size=BLOCK, **overrides)
    return LLMEngine(config=config, loaded=load_model(model_dir, load_tokenizer=False))


def greedy(tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True, logprobs=0)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_adopted_blocks_serve_as_if_computed_here(model_dir, kv_cache_dtype):
    prefill, decode, alone = (engine(model_dir, kv_cache_dtype=kv_cache_dtype) for _ in range(3))
    salt = "tenant-a"
    first = prefill.generate(prompt_token_ids=PROMPTS, params=greedy(1), cache_salt=salt)
    exported = [export_prefix(prefill, ids, salt) for ids in PROMPTS]
    assert [kv.num_tokens for kv in exported] == [len(ids) // BLOCK * BLOCK for ids in PROMPTS]
    assert [import_prefix(decode, kv) for kv in exported] == [kv.num_tokens for kv in exported]

    # The adopted blocks hold exactly what the prefill engine computed.
    for ids in PROMPTS:
        hashes = prefix_block_hashes(ids, BLOCK, salt)
        theirs = prefill.scheduler.block_manager.cached_chain(hashes)
        ours = decode.scheduler.block_manager.cached_chain(hashes)
        assert len(theirs) == len(ours) == len(hashes)
        for a, b in zip(prefill.runner.kv_caches, decode.runner.kv_caches):
            for ta, tb in zip(a.tensors(), b.tensors()):
                assert torch.equal(ta[theirs], tb[ours])

    # Continued there (the prompt and its first token, as a resumed request), it generates what
    # an engine that computed it all generates, finding the prompt's blocks cached.
    resumed = []
    for i, (ids, result) in enumerate(zip(PROMPTS, first)):
        decode.add_request(
            f"r{i}",
            prompt_token_ids=ids,
            params=greedy(12),
            cache_salt=salt,
            resume={0: result.token_ids},
        )
    while decode.has_unfinished():
        resumed += decode.step()
    whole = alone.generate(prompt_token_ids=PROMPTS, params=greedy(12), cache_salt=salt)
    for i, (ids, reference) in enumerate(zip(PROMPTS, whole)):
        final = next(o for o in resumed if o.request_id == f"r{i}" and o.finished)
        assert final.usage.cached_tokens == len(ids) // BLOCK * BLOCK
        tokens = [t for o in resumed if o.request_id == f"r{i}" for t in o.new_token_ids]
        assert first[i].token_ids + tokens == reference.token_ids


def test_blocks_of_another_shape_are_refused(model_dir):
    prefill = engine(model_dir)
    prefill.generate(prompt_token_ids=PROMPTS[:1], params=greedy(1))
    kv = export_prefix(prefill, PROMPTS[0], None)
    assert kv is not None
    other = engine(model_dir, kv_cache_dtype="int8")
    assert import_prefix(other, kv) == 0
    assert other.scheduler.block_manager.cached_chain(kv.hashes) == []
    assert export_prefix(other, PROMPTS[1], None) is None


def test_adopting_a_chain_never_evicts_its_own_blocks():
    manager = BlockManager(num_blocks=6, block_size=BLOCK)  # 5 usable
    hashes = prefix_block_hashes(list(range(8 * BLOCK)), BLOCK)
    adopted = manager.adopt_chain(hashes)
    assert [i for i, _ in adopted] == [0, 1, 2, 3, 4]  # room for five: stops at the gap
    assert manager.cached_chain(hashes) == [b for _, b in adopted]
    # Another chain takes the space of the first one's tail first (its head is kept longest).
    other = prefix_block_hashes(list(range(100, 100 + 2 * BLOCK)), BLOCK)
    assert len(manager.adopt_chain(other)) == 2
    assert len(manager.cached_chain(hashes)) == 3
    assert len(manager.cached_chain(other)) == 2
    # Adopting what is cached already adopts nothing.
    assert manager.adopt_chain(other) == []
