"""The torch paged-attention path against a plain per-sequence reference: decodes of many lengths
read block by block (in runs of cache blocks, with gaps, and with blocks shared by several
sequences), prefill chunks with and without cached context, sliding window, bfloat16."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from sluice.engine import attention
from sluice.engine.attention import kv_cache_shape, paged_attention, plan_torch_attention, write_kv
from sluice.engine.step_plan import build_step_plan

BLOCK = 4
HQ, HKV, D = 6, 2, 8

# decodes of many lengths first, then prefills: a chunk after cached context, a whole prompt
QUERY_LENS = [1, 1, 1, 1, 1, 1, 5, 7]
SEQ_LENS = [3, 40, 9, 17, 41, 2, 23, 7]


def build_plan(query_lens, seq_lens, tables, sliding_window=None):
    """The step planned for the torch attention path, as the torch kernel family plans it."""
    step = build_step_plan(query_lens, seq_lens, tables, BLOCK, sliding_window=sliding_window)
    return replace(step, torch_attention=plan_torch_attention(step, HKV))


def reference(q, k_cache, v_cache, query_lens, seq_lens, tables, scale, window=None):
    """Each new token attends to its own sequence's positions <= its own (and within the window)."""
    out = torch.empty_like(q)
    start = 0
    for qlen, slen, table in zip(query_lens, seq_lens, tables):
        pos = torch.arange(slen)
        blocks = torch.tensor(table)[pos // BLOCK]
        k = (
            k_cache[blocks, :, pos % BLOCK].float().repeat_interleave(HQ // HKV, dim=1)
        )  # [L, Hq, D]
        v = v_cache[blocks, :, pos % BLOCK].float().repeat_interleave(HQ // HKV, dim=1)
        for i in range(qlen):
            qpos = slen - qlen + i
            s = torch.einsum("hd,lhd->hl", q[start + i].float(), k) * scale
            allowed = pos <= qpos
            if window is not None:
                allowed &= pos > qpos - window
            s = s.masked_fill(~allowed, float("-inf"))
            out[start + i] = torch.einsum("hl,lhd->hd", torch.softmax(s, dim=-1), v).to(q.dtype)
        start += qlen
    return out


def make_case(dtype, seed=0, shared_prefix_blocks=0, spread=1):
    """Random caches and block tables; `spread` leaves unused blocks between the used ones; the
    first `shared_prefix_blocks` blocks of the two longest decodes are the same cache blocks."""
    g = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-s // BLOCK) for s in SEQ_LENS]
    num_blocks = (sum(blocks_per_seq) + 3) * spread
    perm = (torch.randperm(num_blocks, generator=g)[: sum(blocks_per_seq)]).tolist()
    tables, at = [], 0
    for n in blocks_per_seq:
        tables.append(perm[at : at + n])
        at += n
    if shared_prefix_blocks:
        tables[4][:shared_prefix_blocks] = tables[1][:shared_prefix_blocks]
    shape = kv_cache_shape(num_blocks, BLOCK, HKV, D)
    k_cache = torch.randn(shape, generator=g).to(dtype)
    v_cache = torch.randn(shape, generator=g).to(dtype)
    q = torch.randn(sum(QUERY_LENS), HQ, D, generator=g).to(dtype)
    return q, k_cache, v_cache, tables


@pytest.mark.parametrize("max_gap", [0, 2, 10**6])  # a run per block ... one run for everything
@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize("shared", [0, 3])
@pytest.mark.parametrize("spread", [1, 4])
def test_matches_reference(monkeypatch, max_gap, window, shared, spread):
    monkeypatch.setattr(attention, "MAX_BLOCK_GAP", max_gap)
    q, k_cache, v_cache, tables = make_case(
        torch.float32, shared_prefix_blocks=shared, spread=spread
    )
    step = build_plan(QUERY_LENS, SEQ_LENS, tables, sliding_window=window)
    out = paged_attention(q, k_cache, v_cache, step, scale=D**-0.5)
    expected = reference(q, k_cache, v_cache, QUERY_LENS, SEQ_LENS, tables, D**-0.5, window)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    plan = step.torch_attention.decodes
    assert (plan.dup_blocks is not None) == bool(shared)
    if max_gap == 10**6:
        assert len(plan.runs) == 1


def test_bfloat16_matches_reference():
    q, k_cache, v_cache, tables = make_case(
        torch.bfloat16, seed=3, shared_prefix_blocks=2, spread=2
    )
    step = build_plan(QUERY_LENS, SEQ_LENS, tables)
    out = paged_attention(q, k_cache, v_cache, step, scale=D**-0.5)
    expected = reference(q, k_cache, v_cache, QUERY_LENS, SEQ_LENS, tables, D**-0.5)
    torch.testing.assert_close(out.float(), expected.float(), rtol=2e-2, atol=2e-2)


def test_prefill_from_own_kv_equals_reading_the_cache_back():
    """A chunk that starts its sequence may attend to the step's own K/V: same result."""
    q, k_cache, v_cache, tables = make_case(torch.float32, seed=5)
    qlens, slens = [7, 5], [7, 5]
    k_new = torch.randn(12, HKV, D)
    v_new = torch.randn(12, HKV, D)
    tables = [tables[7], tables[6]]
    step = build_plan(qlens, slens, tables)
    write_kv(k_new, v_new, k_cache, v_cache, step)
    from_cache = paged_attention(q[:12], k_cache, v_cache, step, scale=D**-0.5)
    from_new = paged_attention(q[:12], k_cache, v_cache, step, scale=D**-0.5, k=k_new, v=v_new)
    torch.testing.assert_close(from_new, from_cache, rtol=1e-6, atol=1e-6)
    expected = reference(q[:12], k_cache, v_cache, qlens, slens, tables, D**-0.5)
    torch.testing.assert_close(from_new, expected, rtol=1e-5, atol=1e-5)


def test_head_size_equal_to_block_size(monkeypatch):
    """Scores ([.., block]) and outputs ([.., D]) are then the same width: the decode path must
    still multiply by K transposed for the one and by V as it is for the other."""
    monkeypatch.setitem(globals(), "D", BLOCK)
    q, k_cache, v_cache, tables = make_case(torch.float32, seed=7, spread=2)
    step = build_plan(QUERY_LENS, SEQ_LENS, tables)
    out = paged_attention(q, k_cache, v_cache, step, scale=D**-0.5)
    expected = reference(q, k_cache, v_cache, QUERY_LENS, SEQ_LENS, tables, D**-0.5)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
