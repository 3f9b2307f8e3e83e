"""A fault while serving one request ends that request, not the batch: the engine narrows a failing
step down to the request that fails it, ends it with finish_reason "error", and the others produce
exactly what they would have without it. Faults are injected through the engine's fault hook."""

from __future__ import annotations

import pytest
from test_engine import save_tiny, tiny_engine

from sluice.engine.engine import LLMEngine
from sluice.engine.output_processor import OutputProcessor
from sluice.engine.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def prompts() -> dict[str, list[int]]:
    return {f"r{i}": list(range(3 + i, 20 + 2 * i)) for i in range(7)}


def run(engine: LLMEngine, requests: dict[str, list[int]]):
    for rid, ids in requests.items():
        engine.add_request(rid, prompt_token_ids=ids, params=GREEDY)
    tokens = {rid: [] for rid in requests}
    finals = {}
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
            if out.finished:
                finals[out.request_id] = out
    return tokens, finals


@pytest.fixture
def engine(tmp_path) -> LLMEngine:
    save_tiny("llama", tmp_path)
    return tiny_engine(tmp_path, max_num_batched_tokens=512)


@pytest.mark.parametrize("poison", ["r0", "r3", "r6"])
def test_a_request_that_fails_every_step_it_is_in_ends_alone(engine, poison):
    clean, _ = run(engine, prompts())

    def hook(batch):
        if any(seq.request_id == poison for seq in batch.seqs):
            raise RuntimeError("this request breaks the kernel")

    engine.fault_hook = hook
    tokens, finals = run(engine, prompts())
    assert finals[poison].finish_reason == "error"
    assert "RuntimeError: this request breaks the kernel" in finals[poison].error
    assert tokens[poison] == []
    for rid in prompts():
        if rid != poison:
            assert finals[rid].finish_reason == "length" and finals[rid].error is None, rid
            assert tokens[rid] == clean[rid], rid  # as if the poison had never been there
    assert not engine.has_unfinished()


def test_a_fault_after_some_tokens_keeps_what_was_produced(engine):
    def hook(batch):
        if any(seq.request_id == "r2" and seq.num_output_tokens >= 5 for seq in batch.seqs):
            raise ValueError("fails at its sixth token")

    engine.fault_hook = hook
    tokens, finals = run(engine, prompts())
    assert finals["r2"].finish_reason == "error" and len(tokens["r2"]) == 5
    assert finals["r2"].usage.completion_tokens == 5
    assert all(finals[r].finish_reason == "length" for r in prompts() if r != "r2")


def test_a_fault_in_one_requests_own_bookkeeping_ends_only_that_request(engine, monkeypatch):
    real = OutputProcessor.ending

    def broken(self, seq, token, params):
        if seq.request_id == "r4" and seq.num_output_tokens == 3:
            raise KeyError("stop check broke")
        return real(self, seq, token, params)

    monkeypatch.setattr(OutputProcessor, "ending", broken)
    tokens, finals = run(engine, prompts())
    assert finals["r4"].finish_reason == "error" and "KeyError" in finals["r4"].error
    assert all(finals[r].finish_reason == "length" for r in prompts() if r != "r4")


def test_a_fault_in_every_step_ends_every_request_and_the_engine_stays_up(engine):
    def hook(batch):
        raise MemoryError("out of memory")

    engine.fault_hook = hook
    tokens, finals = run(engine, prompts())
    assert {f.finish_reason for f in finals.values()} == {"error"}
    engine.fault_hook = None
    again, finals = run(engine, {"after": list(range(5, 25))})
    assert finals["after"].finish_reason == "length" and len(again["after"]) == 12
