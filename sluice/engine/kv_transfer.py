"""A prompt's KV computed by one engine and adopted by another (prefill/decode separation).

The prefill engine computes a prompt and its first token; `export_prefix` then gathers the KV of
the prompt's full blocks from its prefix cache, by their chained hashes. The decode engine
`import_prefix`es them into free blocks of its own, registered in its prefix cache under the same
hashes, so that the request, added next, finds its prompt cached and computes only the tokens
after the last full block. Nothing here is trusted blindly: blocks of another shape or dtype are
refused, and a block that is missing or evicted before the request is added is computed again.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch

from .block_manager import prefix_block_hashes

log = logging.getLogger(__name__)


@dataclass
class KvBlocks:
    """Leading full blocks of a prompt: their chained hashes and, per kind of cache tensor (K, V,
    and their scales when quantized), the blocks of every layer: [layers, blocks, ...]."""

    hashes: list[bytes]
    block_size: int
    tensors: list[torch.Tensor]

    @property
    def num_tokens(self) -> int:
        return len(self.hashes) * self.block_size

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors)


def export_prefix(engine, token_ids: Seq[int], cache_salt: str | None) -> KvBlocks | None:
    """The KV of the longest run of the prompt's full blocks this engine has cached (None when
    it has none). Call on the engine's thread, before a later step may evict them."""
    if engine.config.tensor_parallel_size > 1:
        return None  # this process holds only rank 0's KV heads
    block_size = engine.config.block_size
    hashes = prefix_block_hashes(token_ids, block_size, cache_salt)
    blocks = engine.scheduler.block_manager.cached_chain(hashes)
    if not blocks:
        return None
    caches = engine.runner.kv_caches
    index = torch.tensor(blocks, device=caches[0].k.device)
    kinds = len(caches[0].tensors())
    tensors = [
        torch.stack([cache.tensors()[k].index_select(0, index) for cache in caches]).cpu()
        for k in range(kinds)
    ]
    return KvBlocks(hashes[: len(blocks)], block_size, tensors)


def import_prefix(engine, kv: KvBlocks) -> int:
    """Adopt the blocks into this engine's prefix cache; the number of tokens it now holds cached
    of them (0 when they do not fit this engine's cache). Call on the engine's thread."""
    if engine.config.tensor_parallel_size > 1:
        # blocks written here alone would miss the other ranks' heads
        log.warning("a tensor-parallel engine adopts no KV blocks: computing them instead")
        return 0
    caches = engine.runner.kv_caches
    ours = caches[0].tensors()
    shapes_match = kv.block_size == engine.config.block_size and len(kv.tensors) == len(ours)
    if shapes_match:
        for theirs, mine in zip(kv.tensors, ours):
            same = (theirs.shape[0], *theirs.shape[2:]) == (len(caches), *mine.shape[1:])
            shapes_match &= same and theirs.dtype == mine.dtype
    if not shapes_match:
        log.warning(
            "KV blocks of another shape or dtype (%s) were not adopted: computing them instead",
            [(tuple(t.shape), t.dtype) for t in kv.tensors],
        )
        return 0
    adopted = engine.scheduler.block_manager.adopt_chain(kv.hashes)
    if adopted:
        device = ours[0].device
        rows = torch.tensor([i for i, _ in adopted])
        blocks = torch.tensor([b for _, b in adopted], device=device)
        for kind, tensor in enumerate(kv.tensors):
            chosen = tensor.index_select(1, rows).to(device)
            for layer, cache in enumerate(caches):
                cache.tensors()[kind].index_copy_(0, blocks, chosen[layer])
    cached = engine.scheduler.block_manager.cached_chain(kv.hashes)
    return len(cached) * kv.block_size
