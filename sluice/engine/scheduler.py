"""The batch scheduler: each step, which tokens of which sequences run together.

(Not to be confused with the scheduler *actor*, which routes requests to runners.)

Every sequence is `num_computed_tokens` catching up with its tokens under a per-step token budget
(`max_num_batched_tokens`) and a cap on sequences per step (`max_num_seqs`):

1. running sequences first: decodes (one token each), then unfinished prefill chunks;
2. then new sequences from the waiting queue, ordered by (priority, arrival): lower first.
   A prompt longer than the remaining budget is split into chunks over several steps.

When the KV cache runs out of blocks, the lowest-priority, latest-arrived running sequence is
preempted by recompute: its blocks are freed (they stay in the prefix cache), its
num_computed_tokens drops to 0 and it goes back to the waiting queue with its generated tokens,
so a later prefill covers prompt and output alike. A sequence is only ever preempted for one of
higher priority (smaller (priority, arrival) key) or for itself, so the highest-priority sequence
always makes progress.

Step protocol (the engine's side):
    batch = scheduler.schedule()
    runner.copy_blocks(batch.block_copies); logits = runner.execute(batch)
    for each seq with sample=True: seq.append_token(sampled)
    scheduler.on_step_done(batch)          # advances num_computed_tokens, caches full blocks
    for each seq that hit a stop condition: scheduler.finish(seq)
"""

from __future__ import annotations

import bisect
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from sluice.engine.block_manager import BlockManager
from sluice.engine.errors import ConfigError, EngineError, ErrorCode
from sluice.engine.sequence import Sequence, SequenceStatus

if TYPE_CHECKING:
    from sluice.engine.config import EngineConfig


# How a seq ends that pins its KV when it asks to: it finished its answer (not given up)
_KEEPS_KV = (SequenceStatus.FINISHED_STOPPED, SequenceStatus.FINISHED_LENGTH)


def _key(seq: Sequence) -> tuple[int, float, int]:
    return (seq.priority, seq.arrival_time, seq.seq_id)


@dataclass
class ScheduledBatch:
    seqs: list[Sequence] = field(default_factory=list)  # decodes first, then prefills (chunks)
    # Per seq: tokens computed this step, i.e. token_ids[num_computed_tokens : num_computed_tokens +
    # n].
    num_new_tokens: list[int] = field(default_factory=list)
    # Per seq: True when this step reaches the seq's last token, so its last logits are sampled.
    sample: list[bool] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)  # blocks freed; they recompute later
    block_copies: list[tuple[int, int]] = field(
        default_factory=list
    )  # (src, dst) before the forward

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    @property
    def num_sampled(self) -> int:
        return sum(self.sample)

    def __len__(self) -> int:
        return len(self.seqs)


class BatchScheduler:
    def __init__(self, config: EngineConfig, num_blocks: int, max_model_len: int):
        for name in ("max_num_batched_tokens", "max_num_seqs", "block_size"):
            if getattr(config, name) < 1:
                raise ConfigError(f"must be >= 1, got {getattr(config, name)}", field=name)
        if max_model_len < 1:
            raise ConfigError(f"must be >= 1, got {max_model_len}", field="max_model_len")
        self.config = config
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.max_num_seqs = config.max_num_seqs
        self.max_model_len = max_model_len
        self.block_manager = BlockManager(
            num_blocks, config.block_size, config.enable_prefix_caching
        )
        self.waiting: list[Sequence] = []  # sorted by _key; hold no blocks
        self.running: list[Sequence] = []  # sorted by _key; hold blocks
        self._pending_copies: list[tuple[int, int]] = []  # from fork, emitted with the next batch
        self.num_preemptions = 0

    # --- queue management -------------------------------------------------------------------
    def max_kv_tokens(self, seq: Sequence) -> int:
        """Most KV slots `seq` can ever need: its last sampled token is never computed, and the
        engine stops a seq once it holds max_model_len tokens."""
        return max(seq.num_prompt_tokens, min(seq.max_len - 1, self.max_model_len))

    def add(self, seq: Sequence) -> None:
        """Queue a new sequence; raises EngineError if it could never run in this cache.

        The request itself was checked by the engine (its parameters, its prompt against the
        model); here only what the KV cache can hold."""
        bm = self.block_manager
        need = bm.blocks_for(self.max_kv_tokens(seq))
        if need > bm.num_usable_blocks:
            culprit = (
                "prompt"
                if bm.blocks_for(seq.num_prompt_tokens) > bm.num_usable_blocks
                else "max_tokens"
            )
            raise EngineError(
                f"the request may need {self.max_kv_tokens(seq)} tokens of KV cache "
                f"({need} blocks of {bm.block_size}) but the cache holds only "
                f"{bm.num_usable_blocks} blocks",
                field=culprit,
                code=ErrorCode.EXCEEDS_KV_CACHE,
            )
        seq.status = SequenceStatus.WAITING
        bisect.insort(self.waiting, seq, key=_key)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Add `child`, a sample of the same request, sharing the parent's computed KV.

        Call after on_step_done, with child = parent.fork(...) cut at the prompt and given its
        own first sampled token. Full blocks are shared; the partial block is copied before the
        next forward (in that batch's block_copies). Without room, the child waits and later
        recomputes (reusing the prompt's cached blocks).
        """
        bm = self.block_manager
        if (
            parent.status is SequenceStatus.RUNNING
            and parent.num_computed_tokens > 0
            and len(self.running) < self.max_num_seqs
            and bm.can_fork(parent)
        ):
            self._pending_copies.extend(bm.fork(parent, child))
            child.status = SequenceStatus.RUNNING
            bisect.insort(self.running, child, key=_key)
        else:
            self.add(child)

    def _release(self, seq: Sequence, copies: list[tuple[int, int]]) -> None:
        """Free seq's blocks and drop pending copies into them (their target is gone)."""
        freed = set(self.block_manager.free(seq))
        if freed:
            copies[:] = [c for c in copies if c[1] not in freed]

    def _remove(self, seq: Sequence) -> None:
        queue = self.running if seq.status is SequenceStatus.RUNNING else self.waiting
        i = bisect.bisect_left(queue, _key(seq), key=_key)
        if i < len(queue) and queue[i] is seq:
            del queue[i]
        elif seq in queue:  # key changed after add (should not happen); fall back to a scan
            queue.remove(seq)

    def finish(
        self,
        seq: Sequence,
        status: SequenceStatus,
        now: float,
        stop_reason: str | int | None = None,
    ) -> None:
        """Retire a sequence with how it ended: blocks freed (full ones stay in the prefix cache),
        then its end recorded (`Sequence.finish`). Idempotent: a finished one keeps its end."""
        if seq.is_finished:
            return
        self._remove(seq)
        if seq.keep_kv is not None and status in _KEEPS_KV:
            self.block_manager.pin(seq, time.monotonic() + seq.keep_kv[1])
        self._release(seq, self._pending_copies)
        seq.finish(status, now, stop_reason)

    def abort(
        self, request_id: str, status: SequenceStatus = SequenceStatus.FINISHED_ABORTED
    ) -> list[Sequence]:
        """Finish every sequence of `request_id` (its samples `request_id#i` too) with `status`,
        freeing blocks now."""
        group = request_id + "#"
        hit = [
            s
            for s in self.running + self.waiting
            if s.request_id == request_id or s.request_id.startswith(group)
        ]
        now = time.monotonic()
        for seq in hit:
            self.finish(seq, status, now)
        return hit

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def stats(self) -> dict[str, float]:
        bm = self.block_manager
        return {
            "num_running": len(self.running),
            "num_waiting": len(self.waiting),
            "kv_cache_usage": bm.usage(),
            "num_free_kv_blocks": bm.num_free_blocks,
            "num_kv_blocks": bm.num_usable_blocks,
            "prefix_cache_hit_rate": bm.prefix_hit_rate(),
            "prefix_cache_query_tokens": bm.prefix_query_tokens,
            "prefix_cache_hit_tokens": bm.prefix_hit_tokens,
            "num_preemptions": self.num_preemptions,
            "num_pinned_kv_blocks": bm.num_pinned_blocks,
        }

    # --- one step ---------------------------------------------------------------------------
    def schedule(self, only: set[str] | None = None) -> ScheduledBatch:
        """The next batch; of the sequences of the requests in `only`, when given (the others
        wait, untouched: how the engine narrows down a fault)."""
        bm = self.block_manager
        bm.release_expired_pins(time.monotonic())
        copies, self._pending_copies = self._pending_copies, []
        chosen: dict[int, tuple[Sequence, int]] = {}  # seq_id -> (seq, n), in scheduling order
        preempted: list[Sequence] = []
        budget = self.max_num_batched_tokens

        def preempt(victim: Sequence) -> None:
            nonlocal budget
            if victim.seq_id in chosen:  # scheduled earlier this step: take it back out
                budget += chosen.pop(victim.seq_id)[1]
            self._remove(victim)
            self._release(victim, copies)
            victim.num_computed_tokens = 0
            victim.status = SequenceStatus.WAITING
            bisect.insort(self.waiting, victim, key=_key)
            preempted.append(victim)
            self.num_preemptions += 1

        def freeable_for(seq: Sequence) -> int:
            """Free blocks plus those that dropping the pins and preempting every lower-priority
            running seq release."""
            lower = (v for v in self.running if _key(v) > _key(seq))
            return (
                bm.num_free_blocks
                + bm.num_pin_only_blocks
                + sum(1 for v in lower for b in v.block_table if bm.ref_counts[b] == 1)
            )

        def make_room(seq: Sequence, n: int) -> bool:
            """Drop pins, then preempt running seqs of lower priority than `seq`, until n new
            tokens fit."""
            while not bm.can_allocate(seq, n):
                if bm.drop_oldest_pin():
                    continue
                victim = self.running[-1] if self.running else None
                if victim is None or victim is seq or _key(victim) < _key(seq):
                    return False
                preempt(victim)
            return True

        # 1. Running seqs: decodes first so a long prefill chunk cannot starve them, then chunks.
        running = [s for s in self.running if only is None or s.request_id in only]
        decodes = [s for s in running if s.num_uncomputed_tokens == 1]
        chunks = [s for s in running if s.num_uncomputed_tokens > 1]
        for seq in decodes + chunks:
            if budget == 0 or len(chosen) >= self.max_num_seqs:
                break
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted for a seq scheduled before it
            n = min(seq.num_uncomputed_tokens, budget)
            if not bm.can_allocate(seq, n):
                # A shorter prefill chunk that fits the free blocks (pinned ones count: a running
                # seq comes first) beats preempting anyone.
                room = (
                    len(seq.block_table) + bm.num_free_blocks + bm.num_pin_only_blocks
                ) * bm.block_size - seq.num_computed_tokens
                n = max(1, min(n, room))
            if make_room(seq, n):
                bm.allocate(seq, n)
                chosen[seq.seq_id] = (seq, n)
                budget -= n
            else:
                preempt(seq)  # nobody of lower priority left to evict: recompute it later

        # 2. Waiting seqs in (priority, arrival) order, unless this step already had to preempt
        # (the cache is full; admitting more would only thrash).
        def next_waiting() -> Sequence | None:
            if only is None:
                return self.waiting[0] if self.waiting else None
            return next((s for s in self.waiting if s.request_id in only), None)

        while (
            not preempted
            and (candidate := next_waiting()) is not None
            and budget > 0
            and len(chosen) < self.max_num_seqs
            and len(self.running) < self.max_num_seqs
        ):
            seq = candidate
            cached = bm.num_cached_prefix_tokens(seq)
            n = min(seq.num_tokens - cached, budget)
            # Preempt only if that can make the whole chunk fit (else it was for nothing).
            if bm.num_blocks_needed(seq, n) > freeable_for(seq) or not make_room(seq, n):
                if not self.running and not chosen:
                    raise RuntimeError(
                        f"{seq!r} cannot be scheduled even with an empty KV cache "
                        f"({bm.num_usable_blocks} blocks); "
                        "was it grown past max_tokens/max_model_len?"
                    )
                break
            self.waiting.remove(seq)
            bm.allocate(seq, n)
            assert seq.num_computed_tokens == cached
            seq.status = SequenceStatus.RUNNING
            bisect.insort(self.running, seq, key=_key)
            chosen[seq.seq_id] = (seq, n)
            budget -= n

        picked = list(chosen.values())
        ordered = [p for p in picked if p[0].is_decode] + [p for p in picked if not p[0].is_decode]
        return ScheduledBatch(
            seqs=[s for s, _ in ordered],
            num_new_tokens=[n for _, n in ordered],
            sample=[s.num_computed_tokens + n == s.num_tokens for s, n in ordered],
            preempted=preempted,
            block_copies=copies,
        )

    def on_step_done(self, batch: ScheduledBatch) -> None:
        """After the forward (and after the engine appended sampled tokens): the batch's tokens
        are now in the cache; full blocks become findable by the prefix cache."""
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            if seq.status is not SequenceStatus.RUNNING:
                continue  # finished or aborted while the step ran
            seq.num_computed_tokens += n
            self.block_manager.commit_full_blocks(seq)
