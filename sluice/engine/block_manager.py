"""Paged KV-cache blocks: who holds which block, which blocks are free, and the prefix cache.

The KV cache is `num_blocks` fixed-size blocks of `block_size` token slots. A sequence's
`block_table` lists its blocks in order; token position p lives in slot
`block_table[p // block_size] * block_size + p % block_size`.

Block 0 is the null block: it is never handed out, so padded block-table entries and padded slot
writes (which point at 0) can never clobber live KV. Usable blocks are 1 .. num_blocks-1.

Automatic prefix caching: once every token of a full block is computed, the block is registered
under hash(parent block's hash, its token ids), chained from a root hash that mixes in the extra
keys (the sequence's `cache_salt`, so tenants never share KV). A new sequence first looks up its
longest chain of registered blocks and starts computing after them. Blocks are reference counted;
a block whose count drops to 0 keeps its hash and stays findable until its space is needed.
Free blocks without a hash are handed out first, then cached ones in least-recently-freed order.

Pins: a finished sequence asked to keep its KV (`Sequence.keep_kv`, a key and seconds: a harness
turn whose tools are running, its next turn about to extend the same conversation) keeps its
cached blocks referenced under its key, so no eviction takes them, until the next sequence with
that key has taken its prefix, the time runs out, or the scheduler needs the room for running
sequences (oldest pin first). At most half the cache is pinned.
"""

from __future__ import annotations

import hashlib
import struct
from collections import Counter, OrderedDict, deque
from collections.abc import Sequence as _Seq

from sluice.engine.kv_events import KvEventLog
from sluice.engine.sequence import Sequence

NULL_BLOCK = 0
_HASH_VERSION = b"sluice-prefix-v1"


def root_hash(cache_salt: str | None) -> bytes:
    """Parent hash of a sequence's first block: carries the extra keys into the whole chain."""
    salt = b"\x00" if cache_salt is None else b"\x01" + cache_salt.encode("utf-8")
    return hashlib.blake2b(_HASH_VERSION + salt, digest_size=32).digest()


def hash_block(parent_hash: bytes, token_ids: _Seq[int]) -> bytes:
    """Stable across processes and machines (little-endian int64 tokens), unlike Python's hash()."""
    h = hashlib.blake2b(parent_hash, digest_size=32)
    h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    return h.digest()


def prefix_block_hashes(
    token_ids: _Seq[int], block_size: int, cache_salt: str | None = None
) -> list[bytes]:
    """Chained hashes of every full block of `token_ids` (what a router can use for cache
    affinity)."""
    out: list[bytes] = []
    parent = root_hash(cache_salt)
    for i in range(len(token_ids) // block_size):
        parent = hash_block(parent, token_ids[i * block_size : (i + 1) * block_size])
        out.append(parent)
    return out


class NoFreeBlocksError(RuntimeError):
    """An allocation was attempted without checking `can_allocate` first (a scheduler bug)."""


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (block 0 is reserved), got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[bytes | None] = [None] * num_blocks
        self._hash_to_block: dict[bytes, int] = {}
        # Two free pools: blocks without a hash (no value, reuse first) and cached blocks in
        # least-recently-freed-first order (evicted only when the plain pool is empty).
        self._free_plain: deque[int] = deque(range(1, num_blocks))
        self._free_cached: OrderedDict[int, None] = OrderedDict()
        # Token-level prefix-cache counters (every lookup counts, recomputes after preemption too).
        self.prefix_query_tokens = 0
        self.prefix_hit_tokens = 0
        self.kv_events: KvEventLog | None = None  # set by whoever publishes the cache's changes
        # (cache salt, key) -> (blocks, until: time.monotonic()), oldest first; and how many
        # pins reference each pinned block
        self._pins: OrderedDict[tuple[str | None, str], tuple[list[int], float]] = OrderedDict()
        self._pin_refs: Counter[int] = Counter()

    # --- accounting -------------------------------------------------------------------------
    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now, cached-but-unreferenced ones included."""
        return len(self._free_plain) + len(self._free_cached)

    @property
    def num_cached_free_blocks(self) -> int:
        return len(self._free_cached)

    def usage(self) -> float:
        """Fraction of usable blocks referenced by some sequence (cached free blocks count as
        free)."""
        return 1.0 - self.num_free_blocks / self.num_usable_blocks

    def prefix_hit_rate(self) -> float:
        return (
            self.prefix_hit_tokens / self.prefix_query_tokens if self.prefix_query_tokens else 0.0
        )

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # --- prefix lookup ----------------------------------------------------------------------
    def _seq_hashes(self, seq: Sequence, num_blocks: int) -> list[bytes]:
        """seq.block_hashes extended to at least `num_blocks` full blocks (hashes never change)."""
        hashes = seq.block_hashes
        bs = self.block_size
        parent = hashes[-1] if hashes else root_hash(seq.cache_salt)
        for i in range(len(hashes), num_blocks):
            parent = hash_block(parent, seq.token_ids[i * bs : (i + 1) * bs])
            hashes.append(parent)
        return hashes

    def _lookup(self, seq: Sequence) -> list[int]:
        """Cached blocks matching the seq's longest prefix of full blocks. Never the whole seq:
        at least its last token must be computed so the step yields logits for it."""
        if not self.enable_prefix_caching or seq.block_table:
            return []
        max_blocks = (seq.num_tokens - 1) // self.block_size
        hits: list[int] = []
        for h in self._seq_hashes(seq, max_blocks)[:max_blocks]:
            block = self._hash_to_block.get(h)
            if block is None:
                break
            hits.append(block)
        return hits

    def cached_hashes(self) -> list[bytes]:
        """Every block hash the prefix cache can find now (in use or free)."""
        return list(self._hash_to_block)

    def num_cached_prefix_tokens(self, seq: Sequence) -> int:
        """Tokens `allocate` would take from the prefix cache for a seq holding no blocks (no side
        effects)."""
        return len(self._lookup(seq)) * self.block_size

    # --- allocation -------------------------------------------------------------------------
    def num_blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        """Blocks taken out of the free pools by `allocate(seq, num_new_tokens)`."""
        if seq.block_table:
            computed, have, from_pool = seq.num_computed_tokens, len(seq.block_table), 0
        else:
            hits = self._lookup(seq)
            computed, have = len(hits) * self.block_size, len(hits)
            from_pool = sum(1 for b in hits if self.ref_counts[b] == 0)  # cached but unreferenced
        return from_pool + max(0, self.blocks_for(computed + num_new_tokens) - have)

    def can_allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        return self.num_blocks_needed(seq, num_new_tokens) <= self.num_free_blocks

    def _take_free(self) -> int:
        if self._free_plain:
            block = self._free_plain.popleft()
        elif self._free_cached:
            block, _ = self._free_cached.popitem(last=False)  # evict the least recently freed
            h = self.block_hash[block]
            if h is not None and self._hash_to_block.get(h) == block:
                del self._hash_to_block[h]
                if self.kv_events is not None:
                    self.kv_events.removed(h)
            self.block_hash[block] = None
        else:
            raise NoFreeBlocksError("no free KV blocks (check can_allocate first)")
        self.ref_counts[block] = 1
        return block

    def allocate(self, seq: Sequence, num_new_tokens: int) -> None:
        """Grow seq.block_table to cover its computed tokens plus `num_new_tokens`.

        For a seq holding no blocks (new, or preempted) this first takes its cached prefix:
        seq.num_computed_tokens becomes the number of cached tokens, and `num_new_tokens` counts
        from there. The first allocation ever also sets seq.num_cached_tokens.
        """
        if not self.can_allocate(seq, num_new_tokens):
            raise NoFreeBlocksError(
                f"not enough free KV blocks for {num_new_tokens} tokens of {seq!r}"
            )
        if not seq.block_table:
            if seq.num_computed_tokens != 0:
                raise ValueError(f"{seq!r} holds no blocks but claims computed tokens")
            hits = self._lookup(seq)
            for block in hits:
                if self.ref_counts[block] == 0:
                    del self._free_cached[block]
                self.ref_counts[block] += 1
            seq.block_table = list(hits)
            if seq.keep_kv is not None:  # its prefix is its own now: the pin has done its work
                self._unpin((seq.cache_salt, seq.keep_kv[0]))
            seq.num_committed_blocks = len(hits)  # hit blocks are registered already
            seq.num_computed_tokens = len(hits) * self.block_size
            if self.enable_prefix_caching:
                self.prefix_query_tokens += seq.num_tokens
                self.prefix_hit_tokens += seq.num_computed_tokens
            if not seq.got_first_blocks:
                seq.got_first_blocks = True
                seq.num_cached_tokens = min(seq.num_computed_tokens, seq.num_prompt_tokens)
        need = self.blocks_for(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table)
        for _ in range(need):
            seq.block_table.append(self._take_free())

    def commit_full_blocks(self, seq: Sequence) -> None:
        """Register in the prefix cache every block of `seq` that is now full and fully computed."""
        num_full = seq.num_computed_tokens // self.block_size
        if not self.enable_prefix_caching or num_full <= seq.num_committed_blocks:
            return
        hashes = self._seq_hashes(seq, num_full)
        for i in range(seq.num_committed_blocks, num_full):
            block, h = seq.block_table[i], hashes[i]
            # Another seq may have computed the same block concurrently: keep the first copy
            # findable and leave this one unhashed (it returns to the plain pool when freed).
            if self.block_hash[block] is None and h not in self._hash_to_block:
                self._hash_to_block[h] = block
                self.block_hash[block] = h
                if self.kv_events is not None:
                    self.kv_events.stored(h)
        seq.num_committed_blocks = num_full

    def free(self, seq: Sequence) -> list[int]:
        """Drop seq's references to its blocks (seq.num_computed_tokens is the caller's to reset).

        Blocks are released tail first, so a seq's later blocks are evicted before its earlier
        ones (a chain is useless past its first missing block). Returns the released table.
        """
        table = seq.block_table
        for block in reversed(table):
            self._unref(block)
        seq.block_table = []
        seq.num_committed_blocks = 0
        return table

    def _unref(self, block: int) -> None:
        self.ref_counts[block] -= 1
        if self.ref_counts[block] == 0:
            if self.enable_prefix_caching and self.block_hash[block] is not None:
                self._free_cached[block] = None
            else:
                self._free_plain.append(block)

    # --- pins: a finished seq's KV kept for the next turn -------------------------------------
    def pin(self, seq: Sequence, until: float) -> None:
        """Keep the cached chain of `seq` (finished, asking `keep_kv`, still holding its blocks:
        call before `free`) referenced until `until` (time.monotonic()), replacing the pin its
        key had."""
        if not self.enable_prefix_caching or seq.keep_kv is None:
            return
        key = (seq.cache_salt, seq.keep_kv[0])
        self._unpin(key)
        chain = []
        for block in seq.block_table[: seq.num_committed_blocks]:
            h = self.block_hash[block]
            if h is None or self._hash_to_block.get(h) != block:
                break  # a copy nobody finds (another seq registered the block first)
            chain.append(block)
        if not chain:
            return
        for block in chain:
            self.ref_counts[block] += 1
            self._pin_refs[block] += 1
        self._pins[key] = (chain, until)
        while len(self._pin_refs) > self.num_usable_blocks // 2 and self.drop_oldest_pin():
            pass

    def _unpin(self, key: tuple[str | None, str]) -> None:
        pinned = self._pins.pop(key, None)
        if pinned is None:
            return
        for block in reversed(pinned[0]):  # (tail first, as free() does)
            self._pin_refs[block] -= 1
            if not self._pin_refs[block]:
                del self._pin_refs[block]
            self._unref(block)

    @property
    def num_pinned_blocks(self) -> int:
        return len(self._pin_refs)

    @property
    def num_pin_only_blocks(self) -> int:
        """Pinned blocks that no running seq holds: what dropping every pin would free."""
        return sum(1 for b, n in self._pin_refs.items() if self.ref_counts[b] == n)

    def drop_oldest_pin(self) -> bool:
        """Release the oldest pin; False when there is none."""
        if not self._pins:
            return False
        self._unpin(next(iter(self._pins)))
        return True

    def release_expired_pins(self, now: float) -> None:
        for key in [k for k, (_, until) in self._pins.items() if until <= now]:
            self._unpin(key)

    # --- blocks computed elsewhere (prefill/decode separation) -------------------------------
    def cached_chain(self, hashes: _Seq[bytes]) -> list[int]:
        """The blocks holding the longest leading run of `hashes` (a prompt's chain)."""
        blocks: list[int] = []
        for h in hashes:
            block = self._hash_to_block.get(h)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def adopt_chain(self, hashes: _Seq[bytes]) -> list[tuple[int, int]]:
        """Free blocks to hold a prompt's chain of blocks computed elsewhere, as (index in
        `hashes`, block) for those not cached here already; the caller writes their KV before the
        next step. They join the prefix cache unreferenced, the chain's head the last to be
        evicted. Stops at the first block it cannot have (no free block that is not part of the
        chain itself): a chain is useless past a gap."""
        if not self.enable_prefix_caching:
            return []
        adopted: list[tuple[int, int]] = []
        chain: list[int] = []
        for i, h in enumerate(hashes):
            block = self._hash_to_block.get(h)
            if block is None:
                if not self._free_plain and not (self._free_cached.keys() - set(chain)):
                    break
                block = self._take_free_outside(chain)
                self.ref_counts[block] = 0
                self.block_hash[block] = h
                self._hash_to_block[h] = block
                self._free_cached[block] = None
                if self.kv_events is not None:
                    self.kv_events.stored(h)
                adopted.append((i, block))
            chain.append(block)
        for block in reversed(chain):  # the head last in line for eviction
            if block in self._free_cached:
                self._free_cached.move_to_end(block)
        return adopted

    def _take_free_outside(self, keep: list[int]) -> int:
        """`_take_free`, never evicting one of the blocks in `keep`."""
        if not self._free_plain:
            for block in keep:  # out of the way while the oldest other block is evicted
                if block in self._free_cached:
                    self._free_cached.move_to_end(block)
        return self._take_free()

    # --- n > 1 samples ----------------------------------------------------------------------
    def can_fork(self, parent: Sequence) -> bool:
        partial = parent.num_computed_tokens % self.block_size != 0
        return self.num_free_blocks >= int(partial)

    def fork(self, parent: Sequence, child: Sequence) -> list[tuple[int, int]]:
        """Give `child` (holding no blocks, same first tokens) the parent's computed KV.

        Full computed blocks are shared by reference count (nobody writes into them again); the
        partially filled last block is copied into a new block, since both will append to it.
        Returns the (src, dst) block copies the model runner must do before the next forward.
        """
        if child.block_table:
            raise ValueError(f"fork target {child!r} already holds blocks")
        computed = parent.num_computed_tokens
        if child.num_tokens < computed or child.token_ids[:computed] != parent.token_ids[:computed]:
            raise ValueError("fork: child must start with the parent's computed tokens")
        if not self.can_fork(parent):
            raise NoFreeBlocksError("no free KV block for the forked partial block")
        num_full = computed // self.block_size
        shared = parent.block_table[:num_full]
        for block in shared:
            self.ref_counts[block] += 1
        child.block_table = list(shared)
        copies: list[tuple[int, int]] = []
        if computed % self.block_size:
            dst = self._take_free()
            copies.append((parent.block_table[num_full], dst))
            child.block_table.append(dst)
        child.num_computed_tokens = computed
        child.block_hashes = parent.block_hashes[:num_full]
        child.num_committed_blocks = min(parent.num_committed_blocks, num_full)
        child.num_cached_tokens = parent.num_cached_tokens
        child.got_first_blocks = True
        return copies

    def reset_prefix_cache(self) -> None:
        """Forget every cached block that no sequence references (e.g. between benchmark runs)."""
        for block in self._free_cached:
            h = self.block_hash[block]
            if h is not None and self.kv_events is not None:
                self.kv_events.removed(h)
            self.block_hash[block] = None
            self._free_plain.append(block)
        self._free_cached.clear()
        self._hash_to_block = {
            h: b for h, b in self._hash_to_block.items() if self.ref_counts[b] > 0
        }
