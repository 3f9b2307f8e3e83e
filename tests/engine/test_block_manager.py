"""BlockManager: reference counts, free pools, prefix caching (hits, salts, LRU eviction), fork.

A simulated KV cache (slot -> identity of the token prefix written there) checks what matters in
the end: every position a sequence attends to holds exactly its own token prefix, whether it was
computed, found in the prefix cache, shared by fork or copied.
"""

from __future__ import annotations

import random
from collections import Counter

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from sluice.engine.block_manager import (
    NULL_BLOCK,
    BlockManager,
    NoFreeBlocksError,
    hash_block,
    prefix_block_hashes,
    root_hash,
)
from sluice.engine.kv_events import KvEventLog
from sluice.engine.sequence import Sequence


def make_seq(tokens, salt=None, rid="r"):
    return Sequence(rid, list(tokens), cache_salt=salt, max_tokens=1000)


def compute(bm: BlockManager, seq: Sequence, n: int | None = None) -> None:
    """Allocate and 'compute' n more tokens (default: all the rest), then commit full blocks."""
    if not seq.block_table:
        cached = bm.num_cached_prefix_tokens(seq)
        n = seq.num_tokens - cached if n is None else n
    else:
        n = seq.num_uncomputed_tokens if n is None else n
    bm.allocate(seq, n)
    seq.num_computed_tokens += n
    bm.commit_full_blocks(seq)


class KVSim:
    """Slot -> (salt, prefix identity) of the token written there."""

    def __init__(self, block_size: int):
        self.bs = block_size
        self.slots: dict[int, int] = {}

    @staticmethod
    def ids(seq: Sequence) -> list[int]:
        out, h = [], hash(("salt", seq.cache_salt))
        for t in seq.token_ids:
            h = hash((h, t))
            out.append(h)
        return out

    def slot(self, seq: Sequence, pos: int) -> int:
        block = seq.block_table[pos // self.bs]
        assert block != NULL_BLOCK
        return block * self.bs + pos % self.bs

    def step(self, seq: Sequence, n: int) -> None:
        """Check seq's context is intact, then write its next n tokens."""
        ids, c = self.ids(seq), seq.num_computed_tokens
        for p in range(c):
            assert self.slots.get(self.slot(seq, p)) == ids[p], (
                f"corrupt KV at position {p} of {seq!r}"
            )
        for p in range(c, c + n):
            self.slots[self.slot(seq, p)] = ids[p]

    def copy(self, copies) -> None:
        for src, dst in copies:
            for o in range(self.bs):
                if src * self.bs + o in self.slots:
                    self.slots[dst * self.bs + o] = self.slots[src * self.bs + o]
                else:
                    self.slots.pop(dst * self.bs + o, None)


def check_invariants(bm: BlockManager, seqs: list[Sequence]) -> None:
    held = Counter()
    for s in seqs:
        assert len(set(s.block_table)) == len(s.block_table), "a table holds a block twice"
        assert NULL_BLOCK not in s.block_table
        assert len(s.block_table) >= bm.blocks_for(s.num_computed_tokens)
        held.update(s.block_table)
    plain, cached = list(bm._free_plain), list(bm._free_cached)
    assert len(set(plain)) == len(plain)
    assert not set(plain) & set(cached)
    free = set(plain) | set(cached)
    assert NULL_BLOCK not in free and bm.ref_counts[NULL_BLOCK] == 0
    for b in range(1, bm.num_blocks):
        assert bm.ref_counts[b] == held[b], (
            f"block {b}: refcount {bm.ref_counts[b]} != holders {held[b]}"
        )
        assert (b in free) == (held[b] == 0), f"block {b} free={b in free} but held by {held[b]}"
    assert bm.num_free_blocks + len(held) == bm.num_usable_blocks
    for h, b in bm._hash_to_block.items():
        assert bm.block_hash[b] == h
    for b in range(bm.num_blocks):
        if bm.block_hash[b] is not None:
            assert bm._hash_to_block[bm.block_hash[b]] == b
    assert all(bm.block_hash[b] is not None for b in cached)
    assert all(bm.block_hash[b] is None for b in plain)
    assert 0.0 <= bm.usage() <= 1.0


# --- hashing -----------------------------------------------------------------------------------


def test_hashes_are_chained_salted_and_stable():
    toks = list(range(40))
    hs = prefix_block_hashes(toks, 16)
    assert len(hs) == 2 and len(hs[0]) == 32
    assert hs[1] == hash_block(hs[0], toks[16:32])
    assert hs[0] == hash_block(root_hash(None), toks[:16])
    # Same block contents under a different parent or salt hash differently.
    assert prefix_block_hashes(toks[16:32], 16) != [hs[1]]
    assert prefix_block_hashes(toks, 16, "tenant-a") != hs
    assert root_hash(None) != root_hash("")


def test_hash_is_deterministic_across_processes():
    # Python's hash() is salted per process; ours must not be (routers compare hashes across hosts).
    import subprocess
    import sys

    code = (
        "from sluice.engine.block_manager import prefix_block_hashes as p; "
        "print(p(list(range(8)), 4, 's')[1].hex())"
    )
    outs = {
        subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            check=True,
            env={"PYTHONHASHSEED": str(seed)},
        ).stdout
        for seed in (1, 2)
    }
    assert outs == {prefix_block_hashes(list(range(8)), 4, "s")[1].hex() + "\n"}


# --- allocation --------------------------------------------------------------------------------


def test_null_block_reserved_and_growth_per_token():
    bm = BlockManager(num_blocks=8, block_size=4)
    assert bm.num_usable_blocks == 7 and bm.num_free_blocks == 7
    seq = make_seq(range(5))
    bm.allocate(seq, 5)
    assert len(seq.block_table) == 2 and NULL_BLOCK not in seq.block_table
    seq.num_computed_tokens = 5
    # Decode: L tokens with L-1 computed needs a slot for position L-1.
    for L in range(6, 13):
        seq.append_token(L)
        bm.allocate(seq, 1)
        assert len(seq.block_table) == bm.blocks_for(L)
        seq.num_computed_tokens += 1
    check_invariants(bm, [seq])
    bm.free(seq)
    assert bm.num_free_blocks == 7 and seq.block_table == []


def test_can_allocate_and_error_when_full():
    bm = BlockManager(num_blocks=4, block_size=4, enable_prefix_caching=False)
    a = make_seq(range(12))
    assert bm.can_allocate(a, 12) and not bm.can_allocate(a, 13)
    bm.allocate(a, 12)
    b = make_seq(range(100, 101))
    assert not bm.can_allocate(b, 1)
    with pytest.raises(NoFreeBlocksError):
        bm.allocate(b, 1)
    check_invariants(bm, [a, b])


def test_prefix_hit_512_tokens_and_salt_isolation():
    rng = random.Random(0)
    prefix = [rng.randrange(50000) for _ in range(512)]
    bm = BlockManager(num_blocks=200, block_size=16)
    first = make_seq(prefix + [7, 8, 9], salt="tenant-a")
    compute(bm, first)
    first.append_token(11)  # a generated token, computed in a later step
    compute(bm, first)
    bm.free(first)  # finished: its blocks stay cached

    longer = make_seq(prefix + [1, 2, 3, 4], salt="tenant-a")
    assert bm.num_cached_prefix_tokens(longer) >= 496
    compute(bm, longer, n=longer.num_tokens - bm.num_cached_prefix_tokens(longer))
    assert longer.num_cached_tokens == 512

    # The exact same prompt: never all of it (the last token must be computed for logits).
    same = make_seq(prefix, salt="tenant-a")
    bm.allocate(same, 16)
    assert same.num_cached_tokens == same.num_computed_tokens == 496
    assert same.block_table[:31] == longer.block_table[:31]

    other_tenant = make_seq(prefix + [1, 2], salt="tenant-b")
    assert bm.num_cached_prefix_tokens(other_tenant) == 0
    unsalted = make_seq(prefix + [1, 2])
    assert bm.num_cached_prefix_tokens(unsalted) == 0
    check_invariants(bm, [longer, same])
    assert bm.prefix_hit_tokens == 512 + 496
    assert 0 < bm.prefix_hit_rate() < 1


def test_shared_prefix_blocks_are_refcounted_while_running():
    bm = BlockManager(num_blocks=20, block_size=4)
    a = make_seq(range(10))
    compute(bm, a)
    b = make_seq(list(range(8)) + [99, 98])
    compute(bm, b)
    assert b.num_cached_tokens == 8
    assert a.block_table[:2] == b.block_table[:2]
    assert all(bm.ref_counts[x] == 2 for x in a.block_table[:2])
    check_invariants(bm, [a, b])
    bm.free(a)
    assert all(bm.ref_counts[x] == 1 for x in b.block_table[:2])
    check_invariants(bm, [b])


def test_duplicate_blocks_computed_concurrently_keep_one_cached_copy():
    bm = BlockManager(num_blocks=20, block_size=4)
    a, b = make_seq(range(9)), make_seq(range(9))
    bm.allocate(a, 9)
    bm.allocate(b, 9)  # a's blocks are not committed yet: no hit
    assert b.num_computed_tokens == 0
    for s in (a, b):
        s.num_computed_tokens = 9
        bm.commit_full_blocks(s)
    check_invariants(bm, [a, b])
    assert len(bm._hash_to_block) == 2
    bm.free(a)
    bm.free(b)
    assert bm.num_cached_free_blocks == 2  # b's duplicates went back to the plain pool
    check_invariants(bm, [])
    c = make_seq(range(9))
    assert bm.num_cached_prefix_tokens(c) == 8


def test_lru_eviction_order_and_plain_blocks_first():
    bs = 4
    bm = BlockManager(num_blocks=11, block_size=bs)  # 10 usable
    a = make_seq(range(100, 113))  # 13 tokens: 3 full blocks + 1 partial
    b = make_seq(range(200, 213))
    compute(bm, a)
    compute(bm, b)
    bm.free(a)  # freed first: least recently freed
    bm.free(b)
    check_invariants(bm, [])
    assert bm.num_free_blocks == 10 and bm.num_cached_free_blocks == 6

    probe_a, probe_b = make_seq(range(100, 113)), make_seq(range(200, 213))
    assert bm.num_cached_prefix_tokens(probe_a) == 12 and bm.num_cached_prefix_tokens(probe_b) == 12

    # 4 unhashed blocks (the partial ones + 2 never used) are handed out before any cached one.
    filler = make_seq(range(1000, 1016))
    bm.allocate(filler, 16)
    assert bm.num_cached_prefix_tokens(probe_a) == 12 and bm.num_cached_prefix_tokens(probe_b) == 12
    # The next evictions take a's blocks, tail first: a's prefix shrinks block by block, b's stays.
    for expect_a in (8, 4, 0):
        filler.append_token(1)
        filler.append_token(1)
        filler.append_token(1)
        filler.append_token(1)
        filler.num_computed_tokens = filler.num_tokens - 4
        bm.allocate(filler, 4)
        assert bm.num_cached_prefix_tokens(probe_a) == expect_a
        assert bm.num_cached_prefix_tokens(probe_b) == 12
    check_invariants(bm, [filler])


def test_cache_hit_refreshes_lru_position():
    bm = BlockManager(num_blocks=7, block_size=4)  # 6 usable
    a, b = make_seq(range(9)), make_seq(range(50, 59))  # 2 full blocks + 1 token each
    compute(bm, a)
    bm.free(a)
    compute(bm, b)
    bm.free(b)
    # Reuse a's prefix (a was freed first) then free again: now b's blocks are the oldest.
    a2 = make_seq(range(9))
    compute(bm, a2)
    assert a2.num_cached_tokens == 8
    bm.free(a2)
    big = make_seq(range(500, 512))
    bm.allocate(big, 12)  # takes the 2 plain blocks, then evicts the oldest cached: b's tail
    assert bm.num_cached_prefix_tokens(make_seq(range(9))) == 8
    assert bm.num_cached_prefix_tokens(make_seq(range(50, 59))) == 4


def test_cached_free_blocks_are_reusable_by_anyone():
    bm = BlockManager(num_blocks=9, block_size=4)  # 8 usable
    for start in (0, 100):
        s = make_seq(range(start, start + 16))
        compute(bm, s)
        bm.free(s)
    assert bm.num_cached_free_blocks == 8  # every block of both is full and computed
    big = make_seq(range(1000, 1032))
    assert bm.can_allocate(big, 32)
    bm.allocate(big, 32)
    assert bm.num_free_blocks == 0 and bm.num_cached_free_blocks == 0
    assert not bm._hash_to_block
    check_invariants(bm, [big])


def test_prefix_caching_disabled():
    bm = BlockManager(num_blocks=10, block_size=4, enable_prefix_caching=False)
    a = make_seq(range(9))
    compute(bm, a)
    bm.free(a)
    b = make_seq(range(9))
    assert bm.num_cached_prefix_tokens(b) == 0
    assert bm.num_cached_free_blocks == 0 and bm.prefix_query_tokens == 0
    check_invariants(bm, [])


def test_preempted_seq_recomputes_from_its_own_cached_blocks():
    bm = BlockManager(num_blocks=10, block_size=4)
    s = make_seq(range(6))
    compute(bm, s)
    for t in range(5):
        s.append_token(100 + t)
        compute(bm, s)
    s.append_token(7)  # sampled, not computed yet
    bm.free(s)  # preemption
    s.num_computed_tokens = 0
    assert bm.num_cached_prefix_tokens(s) == 8  # prompt and output blocks alike
    bm.allocate(s, s.num_tokens - 8)
    assert s.num_computed_tokens == 8 and s.num_cached_tokens == 0  # usage keeps the first value


def test_fork_shares_full_blocks_and_copies_the_partial_one():
    bs = 4
    bm = BlockManager(num_blocks=20, block_size=bs)
    kv = KVSim(bs)
    parent = make_seq(range(10))
    bm.allocate(parent, 10)
    kv.step(parent, 10)
    parent.num_computed_tokens = 10
    bm.commit_full_blocks(parent)

    child = parent.fork("r#1", num_tokens=10)
    parent.append_token(500)
    child.append_token(600)
    copies = bm.fork(parent, child)
    assert child.block_table[:2] == parent.block_table[:2]
    assert copies == [(parent.block_table[2], child.block_table[2])]
    assert child.block_table[2] != parent.block_table[2]
    assert all(bm.ref_counts[b] == 2 for b in parent.block_table[:2])
    assert child.num_computed_tokens == 10
    check_invariants(bm, [parent, child])

    kv.copy(copies)
    for s in (parent, child):  # both decode their own token into their own third block
        bm.allocate(s, 1)
        kv.step(s, 1)
        s.num_computed_tokens += 1
    for s in (parent, child):
        kv.step(s, 0)  # context still intact for both

    bm.free(parent)
    check_invariants(bm, [child])
    bm.free(child)
    check_invariants(bm, [])


def test_fork_on_block_boundary_copies_nothing():
    bm = BlockManager(num_blocks=10, block_size=4)
    parent = make_seq(range(8))
    compute(bm, parent)
    child = parent.fork("r#1")
    assert bm.fork(parent, child) == []
    assert child.block_table == parent.block_table
    parent.append_token(1)
    child.append_token(2)
    bm.allocate(parent, 1)
    bm.allocate(child, 1)
    assert parent.block_table[2] != child.block_table[2]
    check_invariants(bm, [parent, child])


def test_reset_prefix_cache():
    bm = BlockManager(num_blocks=10, block_size=4)
    a = make_seq(range(9))
    compute(bm, a)
    bm.free(a)
    bm.reset_prefix_cache()
    assert bm.num_cached_prefix_tokens(make_seq(range(9))) == 0
    check_invariants(bm, [])


# --- random operation sequences ------------------------------------------------------------------

PREFIXES = [[1, 2, 3, 4, 5, 6, 7, 8, 9], [1, 2, 3, 4, 9, 9], [5, 5, 5, 5, 5, 5, 5, 5], []]


class BlockManagerMachine(RuleBasedStateMachine):
    """Random allocate / compute / free / fork / preempt, checking the pools and the KV content."""

    BS = 4

    def __init__(self):
        super().__init__()
        self.bm = BlockManager(num_blocks=13, block_size=self.BS)
        self.bm.kv_events = KvEventLog()
        self.kv = KVSim(self.BS)
        self.seqs: list[Sequence] = []
        self.reported: set[bytes] = set()  # the cache as its KV events tell it

    @initialize(
        prefix=st.sampled_from(PREFIXES), extra=st.lists(st.integers(0, 3), min_size=1, max_size=8)
    )
    def first_seq(self, prefix, extra):
        self.seqs.append(make_seq(prefix + extra))

    @precondition(lambda self: len(self.seqs) < 6)
    @rule(
        prefix=st.sampled_from(PREFIXES),
        extra=st.lists(st.integers(0, 3), min_size=1, max_size=8),
        salt=st.sampled_from([None, None, "t"]),
    )
    def new_seq(self, prefix, extra, salt):
        self.seqs.append(make_seq(prefix + extra, salt=salt))

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def step(self, data):
        seq = data.draw(st.sampled_from(self.seqs))
        if seq.num_uncomputed_tokens == 0:
            seq.append_token(data.draw(st.integers(0, 3)))  # the sample of the last step
        start = (
            self.bm.num_cached_prefix_tokens(seq)
            if not seq.block_table
            else seq.num_computed_tokens
        )
        n = data.draw(st.integers(1, seq.num_tokens - start))
        if not self.bm.can_allocate(seq, n):
            return
        self.bm.allocate(seq, n)
        assert seq.num_computed_tokens == start
        self.kv.step(seq, n)
        seq.num_computed_tokens += n
        self.bm.commit_full_blocks(seq)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data(), keep=st.booleans())
    def free(self, data, keep):
        seq = data.draw(st.sampled_from(self.seqs))
        self.bm.free(seq)
        seq.num_computed_tokens = 0
        if not keep and len(self.seqs) > 1:  # finished; else preempted and will recompute
            self.seqs.remove(seq)

    @precondition(lambda self: any(s.num_computed_tokens for s in self.seqs) and len(self.seqs) < 6)
    @rule(data=st.data(), tok=st.integers(0, 3))
    def fork(self, data, tok):
        parent = data.draw(st.sampled_from([s for s in self.seqs if s.num_computed_tokens]))
        if not self.bm.can_fork(parent):
            return
        child = parent.fork(
            "c", num_tokens=max(parent.num_prompt_tokens, parent.num_computed_tokens)
        )
        if child.num_tokens == parent.num_computed_tokens:
            child.append_token(tok)
        self.kv.copy(self.bm.fork(parent, child))
        self.kv.step(child, 0)
        self.seqs.append(child)

    @invariant()
    def pools_consistent(self):
        check_invariants(self.bm, self.seqs)

    @invariant()
    def every_context_intact(self):
        for seq in self.seqs:
            self.kv.step(seq, 0)

    @invariant()
    def kv_events_tell_the_cache(self):
        """Applying each batch of KV events to a copy of the cache's hashes gives the cache's
        hashes: what a router learns from a runner is what the runner holds."""
        events = self.bm.kv_events.take()
        assert not set(events.stored) & set(events.removed)
        self.reported |= set(events.stored)
        self.reported -= set(events.removed)
        assert self.reported == set(self.bm.cached_hashes())


TestBlockManagerMachine = BlockManagerMachine.TestCase
TestBlockManagerMachine.settings = settings(
    max_examples=200, stateful_step_count=50, deadline=None, suppress_health_check=list(HealthCheck)
)


# --- pins (keep_kv) -------------------------------------------------------------------------------


def finished_with_pin(bm: BlockManager, rid: str, tokens, key: str, until: float = 1e18):
    seq = make_seq(tokens, rid=rid)
    seq.keep_kv = (key, 60.0)
    compute(bm, seq)
    bm.pin(seq, until)
    bm.free(seq)
    return seq


def test_pins_hold_at_most_half_the_cache_the_oldest_going_first():
    bm = BlockManager(num_blocks=21, block_size=4)  # 20 usable
    finished_with_pin(bm, "a", range(24), "run-a")  # 6 full blocks
    assert bm.num_pinned_blocks == 6 and bm.num_free_blocks == 14
    finished_with_pin(bm, "b", range(100, 124), "run-b")  # 12 > 10: run-a's pin goes
    assert bm.num_pinned_blocks == 6
    probe = make_seq(range(24))
    assert bm.num_cached_prefix_tokens(probe) == 20  # still cached, only no longer held
    assert bm.num_free_blocks == 14


def test_a_key_pinned_again_replaces_its_pin_and_its_next_seq_releases_it():
    bm = BlockManager(num_blocks=41, block_size=4)
    first = finished_with_pin(bm, "m0", range(24), "run")
    second = finished_with_pin(bm, "m1", list(range(24)) + [7] * 8, "run")  # extends it
    assert bm.num_pinned_blocks == 8  # one pin: m1's chain (m0's blocks are its first six)
    assert first.block_table == [] and second.block_table == []
    third = make_seq(list(range(24)) + [7] * 8 + [9] * 4, rid="m2")
    third.keep_kv = ("run", 60.0)
    bm.allocate(third, 4)  # takes the cached prefix: the pin is no longer needed
    assert third.num_computed_tokens == 32 and bm.num_pinned_blocks == 0
    bm.free(third)
    assert bm.num_free_blocks == bm.num_usable_blocks
