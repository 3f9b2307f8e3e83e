"""The KV write in C (`cpu_kernels.kv_write`) against the torch reference and the independent model
of the int8 rule in test_kv_cache, from float32 and bfloat16 K/V: every scenario there (blocks
filled over several steps with growing scales, holes, padding tokens, two sequences, block
reuse), byte for byte; and the plain copy into a cache of the K/V's own type."""

from __future__ import annotations

import pytest
import test_kv_cache as t
import torch

from sluice.engine.cpu_kernels.kv_write import write_kv_native


@pytest.fixture(autouse=True)
def native_impl(monkeypatch):
    monkeypatch.setitem(t.IMPLS, "native", write_kv_native)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("sc", t.SCENARIOS, ids=[s.name for s in t.SCENARIOS])
def test_int8_write_follows_the_rule_and_equals_torch(sc, dtype):
    steps = t._build_steps(sc, dtype, seed=len(sc.name))
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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_unquantized_write_is_a_copy_to_the_slots(dtype):
    g = torch.Generator().manual_seed(5)
    qkv = torch.randn(9, 3 * 2 * 16 + 5, generator=g).to(dtype)  # k and v as strided column views
    k = qkv[:, :32].view(9, 2, 16)
    v = qkv[:, 32:64].view(9, 2, 16)
    slots = torch.tensor([17, 18, -1, 3, 4, 5, -1, 40, 41])
    k_cache, v_cache = (torch.full((3, 2, 16, 16), float("nan"), dtype=dtype) for _ in range(2))
    want_k, want_v = k_cache.clone(), v_cache.clone()
    t.kv.write_kv_torch(k, v, want_k, want_v, slots)
    write_kv_native(k, v, k_cache, v_cache, slots)
    assert torch.equal(
        k_cache.nan_to_num(7.0), want_k.nan_to_num(7.0)
    )  # skipped slots left as they were
    assert torch.equal(v_cache.nan_to_num(7.0), want_v.nan_to_num(7.0))


def test_a_cache_of_another_type_is_refused():
    k = torch.randn(2, 2, 16)
    with pytest.raises(ValueError, match="bfloat16"):
        write_kv_native(
            k,
            k,
            *(torch.zeros(3, 2, 16, 16, dtype=torch.bfloat16) for _ in range(2)),
            torch.arange(2),
        )
