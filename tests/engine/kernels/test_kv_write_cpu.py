"""The int8 KV write in C (`cpu_kernels.kv_write`) against the torch reference and the independent
model of the rule in test_kv_cache: every scenario there (blocks filled over several steps with
growing scales, holes, padding tokens, two sequences, block reuse), byte for byte."""
from __future__ import annotations

import pytest
import torch

import test_kv_cache as t
from sluice.engine.cpu_kernels.kv_write import write_kv_native


@pytest.fixture(autouse=True)
def native_impl(monkeypatch):
    monkeypatch.setitem(t.IMPLS, "native", write_kv_native)


@pytest.mark.parametrize("sc", t.SCENARIOS, ids=[s.name for s in t.SCENARIOS])
def test_int8_write_follows_the_rule_and_equals_torch(sc):
    steps = t._build_steps(sc, torch.float32, seed=len(sc.name))
    ref, init, (exp_k, _) = t._run("torch", sc, torch.int8, steps, seed=7, check_each_step=False)
    got, _, _ = t._run("native", sc, torch.int8, steps, seed=7, check_each_step=True)
    t._assert_paths_agree(ref, got, init, exp_k, torch.int8, sc.num_blocks)
    for a, b in zip(ref, got):
        assert torch.equal(a, b)  # same float32 operations in the same order: identical bytes


def test_block_reuse_drops_the_old_scale():
    sc = t.Scenario("reuse", 4, 6, [[1, 4], [4, 1]], [[(0, 5)], [(0, 2)], [(1, 6)], [(1, 1)]])
    steps = t._build_steps(sc, torch.float32, seed=3)
    for k, v, _, _ in steps[:2]:  # the first sequence is loud, the second quiet
        k.mul_(100)
        v.mul_(100)
    ref, init, (exp_k, _) = t._run("torch", sc, torch.int8, steps, seed=9, check_each_step=True)
    got, _, _ = t._run("native", sc, torch.int8, steps, seed=9, check_each_step=True)
    for a, b in zip(ref, got):
        assert torch.equal(a, b)
