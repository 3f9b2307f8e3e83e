"""BatchScheduler driven by a fake engine (no model): budgets, chunked prefill, ordering, priority,
preemption by recompute, abort, fork, prefix reuse, and random workloads that must all finish.

The fake engine follows the real step protocol (schedule -> copies -> forward -> append sampled
tokens -> on_step_done -> finish) and keeps a simulated KV cache (slot -> identity of the token
prefix written there), so any block mix-up shows up as a corrupt context.
"""

from __future__ import annotations

import random
import time

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from sluice.engine.block_manager import NULL_BLOCK
from sluice.engine.config import EngineConfig
from sluice.engine.errors import EngineError, ErrorCode
from sluice.engine.scheduler import BatchScheduler, ScheduledBatch
from sluice.engine.sequence import Sequence, SequenceStatus


def make_sched(
    num_blocks=64, block_size=4, budget=64, max_seqs=8, max_model_len=1024, caching=True
):
    cfg = EngineConfig(
        block_size=block_size,
        max_num_batched_tokens=budget,
        max_num_seqs=max_seqs,
        enable_prefix_caching=caching,
    )
    return BatchScheduler(cfg, num_blocks=num_blocks, max_model_len=max_model_len)


_arrival = iter(range(10**9))


def make_seq(rid, prompt, max_tokens=4, priority=0, salt=None):
    if isinstance(prompt, int):
        prompt = [hash((rid, i)) % 1000 for i in range(prompt)]
    return Sequence(
        rid,
        prompt,
        max_tokens=max_tokens,
        priority=priority,
        arrival_time=float(next(_arrival)),
        cache_salt=salt,
    )


def next_token(seq: Sequence) -> int:
    """Deterministic 'model': the token depends only on the request and the tokens so far."""
    return hash((seq.request_id, tuple(seq.token_ids))) % 1000


class FakeEngine:
    def __init__(self, sched: BatchScheduler):
        self.sched = sched
        self.bs = sched.block_manager.block_size
        self.slots: dict[int, int] = {}
        self.finished: list[Sequence] = []
        self.batches: list[ScheduledBatch] = []

    def _ids(self, seq):
        out, h = [], hash(("salt", seq.cache_salt))
        for t in seq.token_ids:
            h = hash((h, t))
            out.append(h)
        return out

    def _slot(self, seq, p):
        block = seq.block_table[p // self.bs]
        assert block != NULL_BLOCK
        return block * self.bs + p % self.bs

    def check_batch(self, batch: ScheduledBatch) -> None:
        s = self.sched
        assert len(batch.seqs) == len(batch.num_new_tokens) == len(batch.sample)
        assert batch.num_tokens <= s.max_num_batched_tokens
        assert len(batch.seqs) <= s.max_num_seqs
        assert len({q.seq_id for q in batch.seqs}) == len(batch.seqs)
        assert not {q.seq_id for q in batch.seqs} & {q.seq_id for q in batch.preempted}
        kinds = [q.is_decode for q in batch.seqs]
        assert kinds == sorted(kinds, reverse=True), "decodes must come before prefills"
        for q, n, smp in zip(batch.seqs, batch.num_new_tokens, batch.sample):
            assert q.status is SequenceStatus.RUNNING
            assert 1 <= n <= q.num_uncomputed_tokens
            assert smp == (q.num_computed_tokens + n == q.num_tokens)
            assert len(q.block_table) >= s.block_manager.blocks_for(q.num_computed_tokens + n)
        for q in batch.preempted:
            assert (
                q.status is SequenceStatus.WAITING
                and q.block_table == []
                and q.num_computed_tokens == 0
            )
        assert len(s.running) <= s.max_num_seqs

    def step(self) -> ScheduledBatch:
        batch = self.sched.schedule()
        self.check_batch(batch)
        self.batches.append(batch)
        for src, dst in batch.block_copies:
            for o in range(self.bs):
                if src * self.bs + o in self.slots:
                    self.slots[dst * self.bs + o] = self.slots[src * self.bs + o]
        for seq, n in zip(batch.seqs, batch.num_new_tokens):  # the "forward"
            ids, c = self._ids(seq), seq.num_computed_tokens
            for p in range(c):
                assert self.slots.get(self._slot(seq, p)) == ids[p], f"corrupt KV at {p} of {seq!r}"
            for p in range(c, c + n):
                self.slots[self._slot(seq, p)] = ids[p]
        sampled = [q for q, smp in zip(batch.seqs, batch.sample) if smp]
        for seq in sampled:
            seq.append_token(next_token(seq))
        self.sched.on_step_done(batch)
        for seq in sampled:
            if (
                seq.num_output_tokens >= seq.max_tokens
                or seq.num_tokens >= self.sched.max_model_len
            ):
                self.sched.finish(seq, SequenceStatus.FINISHED_LENGTH, time.monotonic())
                self.finished.append(seq)
        return batch

    def run(self, max_steps=10_000) -> int:
        steps = 0
        while self.sched.has_unfinished():
            self.step()
            steps += 1
            assert steps < max_steps, "scheduler did not make progress"
        assert (
            self.sched.block_manager.num_free_blocks == self.sched.block_manager.num_usable_blocks
        )
        return steps


def reference_output(prompt, rid, max_tokens):
    seq = Sequence(rid, prompt, max_tokens=max_tokens)
    while seq.num_output_tokens < max_tokens:
        seq.append_token(next_token(seq))
    return seq.output_token_ids


# --- admission ---------------------------------------------------------------------------------


def test_rejects_requests_that_can_never_fit():
    s = make_sched(num_blocks=5, block_size=4, max_model_len=100)  # 4 usable blocks = 16 tokens
    with pytest.raises(EngineError) as e:
        s.add(make_seq("a", 20, max_tokens=1))
    assert e.value.field == "prompt" and "only 4 blocks" in str(e.value)
    assert e.value.code == ErrorCode.EXCEEDS_KV_CACHE
    with pytest.raises(EngineError) as e:
        s.add(make_seq("b", 10, max_tokens=20))
    assert e.value.field == "max_tokens"
    # (an empty prompt, or one longer than the context, is the engine's to reject: test_engine)
    # 10 prompt + 7 generated = 17 tokens, but the last sample is never computed: 16 slots fit.
    s.add(make_seq("e", 10, max_tokens=7))
    # max_tokens past max_model_len is capped by the engine stopping at max_model_len.
    s2 = make_sched(num_blocks=5, block_size=4, max_model_len=16)
    capped = make_seq("f", 10, max_tokens=1000)
    s2.add(capped)
    FakeEngine(s2).run()
    assert capped.num_tokens == 16


def test_max_len_run_fits_exactly():
    s = make_sched(num_blocks=5, block_size=4, max_model_len=100)
    seq = make_seq("a", 10, max_tokens=7)
    s.add(seq)
    FakeEngine(s).run()
    assert seq.num_output_tokens == 7


# --- chunked prefill, budgets and ordering -------------------------------------------------------


def test_chunked_prefill_covers_exactly_the_prompt():
    s = make_sched(budget=32, num_blocks=64)
    seq = make_seq("a", 100, max_tokens=3)
    s.add(seq)
    eng = FakeEngine(s)
    covered = []
    for _ in range(4):
        b = eng.step()
        assert b.seqs == [seq]
        covered.append(
            (seq.num_computed_tokens - b.num_new_tokens[0], b.num_new_tokens[0], b.sample[0])
        )
    assert covered == [(0, 32, False), (32, 32, False), (64, 32, False), (96, 4, True)]
    assert seq.num_tokens == 101 and seq.num_computed_tokens == 100
    eng.run()
    assert seq.output_token_ids == reference_output(seq.prompt_token_ids, "a", 3)


def test_decodes_before_prefills_and_running_before_waiting():
    s = make_sched(budget=16, max_seqs=8)
    a = make_seq("a", 8, max_tokens=10)
    s.add(a)
    eng = FakeEngine(s)
    eng.step()  # a's prefill
    b, c = make_seq("b", 40, max_tokens=2), make_seq("c", 40, max_tokens=2)
    s.add(b)
    s.add(c)
    batch = eng.step()
    assert batch.seqs == [a, b] and batch.num_new_tokens == [1, 15]
    batch = eng.step()
    # b is running (a prefill chunk) and c waits: a's decode, then b's chunk; no budget left for c.
    assert batch.seqs == [a, b] and batch.num_new_tokens == [1, 15]
    batch = eng.step()
    assert batch.seqs == [a, b, c] and batch.num_new_tokens == [1, 10, 5]
    batch = eng.step()
    assert batch.seqs[:2] == [a, b] and batch.num_new_tokens[:2] == [1, 1]  # b decodes now
    eng.run()


def test_running_decodes_are_not_starved_by_an_urgent_long_prefill():
    s = make_sched(num_blocks=100, budget=16)
    low = make_seq("low", 4, max_tokens=20, priority=1)
    s.add(low)
    eng = FakeEngine(s)
    eng.step()
    urgent = make_seq("urgent", 100, max_tokens=1, priority=0)
    s.add(urgent)
    for _ in range(3):
        batch = eng.step()
        # Each decode costs one token of the budget; the prefill chunk takes the rest.
        assert batch.seqs == [low, urgent] and batch.num_new_tokens == [1, 15]
    eng.run()


def test_budget_and_max_num_seqs_never_exceeded():
    s = make_sched(num_blocks=200, budget=24, max_seqs=3)
    rng = random.Random(1)
    seqs = [make_seq(f"r{i}", rng.randint(1, 60), max_tokens=rng.randint(1, 8)) for i in range(12)]
    for q in seqs:
        s.add(q)
    eng = FakeEngine(s)
    eng.run()  # check_batch asserts the limits every step
    assert max(len(b.seqs) for b in eng.batches) == 3
    assert max(b.num_tokens for b in eng.batches) == 24
    for q in seqs:
        assert q.output_token_ids == reference_output(
            q.prompt_token_ids, q.request_id, q.max_tokens
        )


def test_priority_then_arrival_order():
    s = make_sched(budget=8, max_seqs=8)
    order = [("late-urgent", 0), ("normal-1", 5), ("normal-2", 5), ("urgent", 0), ("background", 9)]
    seqs = {}
    for rid, prio in order:
        seqs[rid] = make_seq(rid, 8, max_tokens=1, priority=prio)
        s.add(seqs[rid])
    eng = FakeEngine(s)
    first_scheduled = []
    while s.has_unfinished():
        for q in eng.step().seqs:
            if q.request_id not in first_scheduled:
                first_scheduled.append(q.request_id)
    assert first_scheduled == ["late-urgent", "urgent", "normal-1", "normal-2", "background"]


# --- preemption ----------------------------------------------------------------------------------


def test_preemption_under_tiny_cache_finishes_everything_with_the_same_output():
    s = make_sched(num_blocks=9, block_size=4, budget=16, max_seqs=6)  # 8 usable blocks
    rng = random.Random(2)
    seqs = [make_seq(f"r{i}", rng.randint(3, 12), max_tokens=rng.randint(5, 18)) for i in range(8)]
    for q in seqs:
        s.add(q)
    eng = FakeEngine(s)
    eng.run()
    assert s.num_preemptions > 0
    assert any(b.preempted for b in eng.batches)
    for q in seqs:
        assert q.status is SequenceStatus.FINISHED_LENGTH
        assert q.num_output_tokens == q.max_tokens
        assert q.output_token_ids == reference_output(
            q.prompt_token_ids, q.request_id, q.max_tokens
        )


def test_preempted_seq_recomputes_prompt_and_output():
    s = make_sched(num_blocks=7, block_size=4, budget=64, caching=False)  # 6 usable blocks
    a = make_seq("a", 8, max_tokens=12, priority=0)
    b = make_seq("b", 8, max_tokens=12, priority=1)
    s.add(a)
    s.add(b)
    eng = FakeEngine(s)
    preempted_at = None
    while preempted_at is None:
        batch = eng.step()
        if batch.preempted:
            assert batch.preempted == [b] and b not in batch.seqs  # lowest priority goes first
            preempted_at = b.num_tokens
    assert b.num_output_tokens > 0 and b.status is SequenceStatus.WAITING
    while b.num_computed_tokens == 0:
        batch = eng.step()
    i = batch.seqs.index(b)
    # Recompute covers prompt and generated tokens in one go, sampling the next token at the end.
    assert batch.num_new_tokens[i] == preempted_at and batch.sample[i]
    eng.run()
    assert b.output_token_ids == reference_output(b.prompt_token_ids, "b", 12)


def test_urgent_waiting_request_preempts_lower_priority_running():
    s = make_sched(num_blocks=7, block_size=4, budget=64)  # 6 usable blocks
    low = make_seq("low", 16, max_tokens=8, priority=5)
    s.add(low)
    eng = FakeEngine(s)
    eng.step()
    urgent = make_seq("urgent", 12, max_tokens=2, priority=0)
    s.add(urgent)
    batch = eng.step()
    assert batch.preempted == [low] and batch.seqs == [urgent]
    eng.run()
    assert low.num_output_tokens == 8


def test_equal_priority_waiting_does_not_preempt_running():
    s = make_sched(num_blocks=7, block_size=4, budget=64)
    first = make_seq("first", 16, max_tokens=8)
    s.add(first)
    eng = FakeEngine(s)
    eng.step()
    s.add(make_seq("second", 12, max_tokens=2))
    batch = eng.step()
    assert batch.seqs == [first] and not batch.preempted
    eng.run()


def test_grown_past_capacity_is_an_error_not_a_hang():
    s = make_sched(num_blocks=3, block_size=4)  # 2 usable blocks = 8 tokens
    seq = make_seq("a", 4, max_tokens=4)
    s.add(seq)
    eng = FakeEngine(s)
    eng.step()
    for t in range(8):  # an engine that ignores max_tokens
        seq.append_token(t)
    with pytest.raises(RuntimeError, match="empty KV cache"):
        for _ in range(20):
            eng.step()


# --- abort, finish, fork, prefix reuse ---------------------------------------------------------


def test_abort_frees_blocks_immediately_wherever_the_seq_is():
    s = make_sched(num_blocks=20, block_size=4, budget=8, max_seqs=2)
    bm = s.block_manager
    a, b, c = make_seq("a", 12), make_seq("b", 12), make_seq("c", 12)
    for q in (a, b, c):
        s.add(q)
    eng = FakeEngine(s)
    eng.step()
    assert a.block_table and c.status is SequenceStatus.WAITING
    free_before, held = bm.num_free_blocks, len(a.block_table)
    assert s.abort("a") == [a]
    assert bm.num_free_blocks == free_before + held and a.block_table == []
    assert a.status is SequenceStatus.FINISHED_ABORTED and a.finish_reason == "abort"
    assert s.abort("c") == [c] and c not in s.waiting
    assert s.abort("nope") == []
    eng.run()
    assert b.num_output_tokens == b.max_tokens


def test_abort_covers_all_samples_of_a_request():
    s = make_sched()
    q0, q1, other = make_seq("req#0", 5), make_seq("req#1", 5), make_seq("req2", 5)
    for q in (q0, q1, other):
        s.add(q)
    FakeEngine(s).step()
    assert {q.request_id for q in s.abort("req")} == {"req#0", "req#1"}
    assert s.running == [other]


def test_abort_between_schedule_and_step_done():
    s = make_sched()
    a = make_seq("a", 6)
    s.add(a)
    batch = s.schedule()
    s.abort("a")
    s.on_step_done(batch)  # must not resurrect it
    assert a.num_computed_tokens == 0 and not s.has_unfinished()
    assert s.block_manager.num_free_blocks == s.block_manager.num_usable_blocks


def test_fork_shares_prompt_blocks_and_copies_partial_block():
    s = make_sched(num_blocks=40, block_size=4, budget=64)
    bm = s.block_manager
    parent = make_seq("r#0", 10, max_tokens=5)
    s.add(parent)
    eng = FakeEngine(s)
    batch = s.schedule()
    assert batch.sample == [True]
    # Run this step by hand, forking after on_step_done like the engine does.
    for p in range(10):
        eng.slots[eng._slot(parent, p)] = eng._ids(parent)[p]
    samples = [101, 202, 303]
    children = []
    parent.append_token(samples[0])
    s.on_step_done(batch)
    for i, tok in enumerate(samples[1:], start=1):
        child = parent.fork(f"r#{i}", num_tokens=parent.num_prompt_tokens)
        child.append_token(tok)
        s.fork(parent, child)
        children.append(child)
    for child in children:
        assert child.status is SequenceStatus.RUNNING and child.num_computed_tokens == 10
        assert child.block_table[:2] == parent.block_table[:2]
        assert child.block_table[2] != parent.block_table[2]
    assert all(bm.ref_counts[b] == 3 for b in parent.block_table[:2])
    batch = eng.step()
    assert sorted(batch.block_copies) == sorted(
        (parent.block_table[2], c.block_table[2]) for c in children
    )
    assert batch.seqs == [parent] + children and batch.num_new_tokens == [1, 1, 1]
    eng.run()
    outs = {tuple(q.output_token_ids) for q in [parent] + children}
    assert len(outs) == 3 and all(len(o) == 5 for o in outs)
    assert [q.output_token_ids[0] for q in [parent] + children] == samples


def test_fork_without_room_falls_back_to_waiting():
    s = make_sched(num_blocks=4, block_size=4, budget=64)  # 3 usable blocks
    parent = make_seq("r#0", 10, max_tokens=2)
    s.add(parent)
    eng = FakeEngine(s)
    batch = s.schedule()
    for p in range(10):
        eng.slots[eng._slot(parent, p)] = eng._ids(parent)[p]
    parent.append_token(1)
    s.on_step_done(batch)
    child = parent.fork("r#1", num_tokens=10)
    child.append_token(2)
    s.fork(parent, child)  # no free block for the partial copy
    assert child.status is SequenceStatus.WAITING and child.block_table == []
    eng.run()
    assert child.num_output_tokens == 2 and child.output_token_ids[0] == 2


def test_second_turn_reuses_the_first_turns_kv():
    s = make_sched(num_blocks=300, block_size=16, budget=2048)
    rng = random.Random(3)
    shared = [rng.randrange(1000) for _ in range(512)]
    first = make_seq("t1", shared + [1, 2, 3], max_tokens=20, salt="tenant")
    s.add(first)
    eng = FakeEngine(s)
    eng.run()
    second = make_seq("t2", shared + [9] * 30, max_tokens=3, salt="tenant")
    s.add(second)
    batch = eng.step()
    assert second.num_cached_tokens >= 496
    assert batch.num_new_tokens == [
        second.num_tokens - 1 - second.num_cached_tokens
    ]  # after the sample
    other = make_seq("t3", shared + [9] * 30, max_tokens=3, salt="someone-else")
    s.add(other)
    eng.run()
    assert other.num_cached_tokens == 0
    assert s.stats()["prefix_cache_hit_tokens"] >= 496
    # The whole first conversation (prompt + answer) is reusable by a third turn.
    third = make_seq("t4", first.token_ids + [5] * 20, max_tokens=1, salt="tenant")
    s.add(third)
    eng.run()
    assert third.num_cached_tokens == (first.num_tokens - 1) // 16 * 16


# --- keep_kv: a finished turn's KV pinned for the next one ----------------------------------------


def turn(rid, prompt, keep, max_tokens=3):
    seq = make_seq(rid, prompt, max_tokens=max_tokens)
    seq.keep_kv = keep
    return seq


def finish_all(eng: FakeEngine) -> None:
    """FakeEngine.run without its check that every block is free (pins hold some)."""
    while eng.sched.has_unfinished():
        eng.step()


@pytest.mark.parametrize("keep", [None, ("run-1", 60.0)])
def test_a_kept_turn_survives_other_requests_filling_the_cache(keep):
    """A harness's turn ends and its tools run while other requests fill the cache: pinned, its
    KV is all there for the next turn; unpinned, the least recently freed blocks (its own) were
    evicted."""
    s = make_sched(num_blocks=41, block_size=4, budget=64)
    eng = FakeEngine(s)
    first = turn("m0", 40, keep)
    s.add(first)
    finish_all(eng)
    for i in range(3):  # others, each needing most of the cache
        s.add(make_seq(f"other-{i}", 100, max_tokens=2))
        finish_all(eng)
    assert s.num_preemptions == 0
    second = turn("m1", first.token_ids + [7] * 8, keep)
    s.add(second)
    eng.step()
    kept = (first.num_tokens - 1) // 4 * 4  # its full blocks: all but its last token's KV
    assert second.num_cached_tokens == (kept if keep else 0)
    if keep:
        # the next turn took its prefix: the pin is gone, its own takes over when it ends
        assert s.stats()["num_pinned_kv_blocks"] == 0
        finish_all(eng)
        assert s.stats()["num_pinned_kv_blocks"] == (second.num_tokens - 1) // 4


def test_pins_give_way_to_running_requests_and_expire():
    s = make_sched(num_blocks=41, block_size=4, budget=64)
    bm, eng = s.block_manager, FakeEngine(s)
    first = turn("m0", 40, ("run-1", 60.0))
    s.add(first)
    finish_all(eng)
    assert bm.num_pinned_blocks == 10 and bm.num_pin_only_blocks == 10
    big = make_seq("big", 150, max_tokens=2)  # needs 38 of the 40 blocks: the pin must go
    s.add(big)
    eng.run()
    assert big.is_finished and s.num_preemptions == 0 and bm.num_pinned_blocks == 0
    again = turn("m0b", 40, ("run-2", 60.0))
    s.add(again)
    finish_all(eng)
    assert bm.num_pinned_blocks == 10
    bm.release_expired_pins(time.monotonic() + 61)
    assert bm.num_pinned_blocks == 0 and bm.num_free_blocks == bm.num_usable_blocks


def test_an_aborted_turn_keeps_nothing():
    s = make_sched(num_blocks=41, block_size=4, budget=64)
    eng = FakeEngine(s)
    first = turn("m0", 40, ("run-1", 60.0))
    s.add(first)
    eng.step()
    s.abort("m0")
    assert s.stats()["num_pinned_kv_blocks"] == 0


# --- random workloads -----------------------------------------------------------------------------


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    num_blocks=st.integers(5, 24),
    block_size=st.sampled_from([1, 2, 4, 8]),
    budget=st.integers(1, 48),
    max_seqs=st.integers(1, 6),
    caching=st.booleans(),
    reqs=st.lists(
        st.tuples(
            st.integers(1, 24),
            st.integers(1, 16),
            st.integers(0, 2),
            st.integers(0, 2),
            st.integers(0, 4),
        ),
        min_size=1,
        max_size=10,
    ),
    data=st.data(),
)
def test_random_workloads_finish_with_correct_output(
    num_blocks, block_size, budget, max_seqs, caching, reqs, data
):
    s = make_sched(
        num_blocks=num_blocks,
        block_size=block_size,
        budget=budget,
        max_seqs=max_seqs,
        caching=caching,
        max_model_len=64,
    )
    eng = FakeEngine(s)
    prefixes = [[7] * 9, [1, 2, 3, 4, 5, 6], []]
    accepted, pending = [], list(enumerate(reqs))
    steps = 0
    while pending or s.has_unfinished():
        # Requests arrive between steps; some get aborted.
        for _ in range(data.draw(st.integers(0, 3), label="arrivals")):
            if not pending:
                break
            i, (plen, max_tokens, prio, pfx, abort_after) = pending.pop(0)
            q = make_seq(
                f"q{i}",
                prefixes[pfx] + [i] * plen,
                max_tokens=max_tokens,
                priority=prio,
                salt=None if i % 3 else "s",
            )
            try:
                s.add(q)
            except EngineError:
                assert (
                    s.block_manager.blocks_for(s.max_kv_tokens(q))
                    > s.block_manager.num_usable_blocks
                )
                continue
            accepted.append((q, abort_after))
        if s.has_unfinished():
            eng.step()
            steps += 1
            for q, abort_after in accepted:
                if abort_after and steps == abort_after * 7 and not q.is_finished:
                    s.abort(q.request_id)
        assert steps < 5000
    bm = s.block_manager
    assert bm.num_free_blocks == bm.num_usable_blocks
    event("preempted" if s.num_preemptions else "no preemption")
    for q, _ in accepted:
        assert q.status in (SequenceStatus.FINISHED_LENGTH, SequenceStatus.FINISHED_ABORTED)
        if q.finish_reason != "abort":
            expect = reference_output(q.prompt_token_ids, q.request_id, q.max_tokens)
            assert q.output_token_ids == expect


def test_aborted_fork_child_drops_its_pending_copy():
    s = make_sched(num_blocks=20, block_size=4)
    parent = make_seq("r#0", 6, max_tokens=3)
    s.add(parent)
    batch = s.schedule()
    parent.append_token(1)
    s.on_step_done(batch)
    child = parent.fork("r#1", num_tokens=6)
    child.append_token(2)
    s.fork(parent, child)
    assert s._pending_copies
    s.abort("r#1")
    assert s.schedule().block_copies == []


def test_sequence_helpers_and_config_validation():
    q = Sequence("x", [5, 6, 7], max_tokens=2)
    q.append_token(8)
    assert (q.num_tokens, q.num_output_tokens, q.prompt_token_ids, q.output_token_ids) == (
        4,
        1,
        [5, 6, 7],
        [8],
    )
    assert q.last_token_id == 8 and not q.is_prefill_done and q.max_len == 5
    with pytest.raises(ValueError):
        q.fork("y", num_tokens=2)  # would cut into the prompt
    c = q.fork("y")
    assert c.token_ids == q.token_ids and c.token_ids is not q.token_ids and c.seq_id != q.seq_id
    with pytest.raises(EngineError) as e:
        make_sched(budget=0)
    assert e.value.field == "max_num_batched_tokens"
