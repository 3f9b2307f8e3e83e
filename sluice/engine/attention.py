"""Paged attention over a flat batch on the torch path: KV-cache writes and attention.

One forward step carries the new tokens of many sequences back to back (decodes and prefill
chunks mixed). Each layer writes its new K/V into the paged cache through `slot_mapping`, then
every new token attends to its sequence's whole context, read back through the block table.

The cache of one layer is [num_blocks, Hkv, block_size, D] (`kv_cache_shape`): head-major inside a
block, so block b of head h is one contiguous [block_size, D] matrix.

The torch path plans once per step (`plan_torch_attention`, a `TorchAttentionPlan` the model
runner puts in the step's `StepPlan`, shared by all layers).
Decodes (one new token) attend block by block, reading K/V in place: each cache block in use gets
its owner's query, one batched matmul over a run of consecutive cache blocks gives every block's
scores, the scores are softmaxed per sequence, and a second batched matmul over the same blocks
gives partial outputs that are summed per sequence. Nothing is gathered or padded but the small
score tensors; with 64 decodes of ~300-token contexts this was ~8x faster than gathering K/V into
a padded batch for SDPA (SmolLM2, float32, 2 cores). Each prefill chunk runs on its own through
SDPA, with a causal mask shifted by the tokens already in the cache (or `is_causal`, on the step's
own K/V, when the chunk is the start of its sequence), so no query is ever padded.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from .step_plan import StepPlan


def kv_cache_shape(
    num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int
) -> tuple[int, int, int, int]:
    """Shape of one layer's K (or V) cache."""
    return (num_blocks, num_kv_heads, block_size, head_dim)


def _write_rows(slots: np.ndarray, block_size: int, num_kv_heads: int) -> np.ndarray:
    """[T] slots -> [T * Hkv] rows (token-major) of the cache viewed as [num_slots * Hkv, D]."""
    heads = np.arange(num_kv_heads)[None, :]
    return (
        ((slots // block_size)[:, None] * num_kv_heads + heads) * block_size
        + (slots % block_size)[:, None]
    ).reshape(-1)


def write_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: StepPlan
) -> None:
    """k, v [T, Hkv, D] -> the cache slots of the step (cache as in `kv_cache_shape`), through the
    rows `plan.torch_attention.write_rows`."""
    d = k_cache.shape[-1]
    rows = _torch_plan(plan).write_rows
    if rows is None:
        raise ValueError("the step was planned without the torch path's KV write rows")
    k_cache.view(-1, d).index_copy_(0, rows, k.reshape(-1, d).to(k_cache.dtype))
    v_cache.view(-1, d).index_copy_(0, rows, v.reshape(-1, d).to(v_cache.dtype))


# Decode blocks are read in runs of consecutive cache blocks, one batched matmul per run. Blocks
# inside a run that no decode uses (free, cached, or a prefill's) are computed and thrown away:
# a gap of up to this many blocks is cheaper to compute than a run of its own.
MAX_BLOCK_GAP = 32


@dataclass
class _Prefill:
    start: int  # first token in the flat batch
    end: int
    blocks: torch.Tensor  # [Hkv * nblk] rows of the cache viewed as [num_blocks * Hkv, bs * D]
    length: int  # L, context length after this step
    mask: torch.Tensor | None  # [Lq, L] bool (True = attend), None -> plain causal
    start_of_seq: bool  # no context from earlier steps: the chunk's own K/V are all it reads


@dataclass
class _Decodes:
    """Decode sequences d = 0..n-1 and the cache blocks they read, as `rows` of work: row r is cache
    block `block` (of each KV head) read for sequence `owner` (n = nobody: a gap in a run)."""

    tokens: torch.Tensor  # [n] flat-batch index of each decode token
    runs: list[tuple[int, int, int]]  # (first row, first cache block, number of blocks): in place
    dup_blocks: (
        torch.Tensor | None
    )  # cache blocks read by a second sequence (shared prefix): gathered
    dup_start: int  # first row of the gathered blocks
    num_rows: int
    q_owner: torch.Tensor  # [rows] whose query each row uses (gaps use sequence 0, thrown away)
    grid: torch.Tensor  # [n * maxblk] row holding block j of sequence d (padding -> row `num_rows`,
    #                     an extra row of zeros)
    row_grid: torch.Tensor  # [rows] inverse: grid position of each row (gaps -> 0)
    max_blocks: int
    mask: torch.Tensor  # [n, 1, 1, maxblk * bs] additive 0 / -inf, float32


@dataclass
class TorchAttentionPlan:
    decodes: _Decodes | None  # None: no decodes, or a decode kernel reads the cache itself
    prefills: list[_Prefill]
    write_rows: torch.Tensor | None  # [T * Hkv] cache rows written by write_kv (None: not planned)


def _torch_plan(plan: StepPlan) -> TorchAttentionPlan:
    if not isinstance(plan.torch_attention, TorchAttentionPlan):
        raise ValueError("the step was planned without the torch attention path (KernelOps.plan)")
    return plan.torch_attention


def _plan_decodes(
    dec: np.ndarray,
    slens: np.ndarray,
    qsl: np.ndarray,
    bt: np.ndarray,
    bs: int,
    win: int | None,
    dev,
) -> _Decodes:
    n = len(dec)
    lens = slens[dec]
    nblk = -(-lens // bs)
    maxblk = int(nblk.max())
    grid_valid = np.arange(maxblk)[None, :] < nblk[:, None]  # [n, maxblk]
    pair_seq = np.repeat(np.arange(n), nblk)  # pairs (sequence, its j-th block), sequence-major
    pair_grid = np.flatnonzero(
        grid_valid.reshape(-1)
    )  # grid position (d * maxblk + j) of each pair
    pair_blk = bt[dec][:, :maxblk][grid_valid]
    # A cache block shared by several decodes (a common prefix) is read in place for the first and
    # gathered for the others.
    uniq, first = np.unique(pair_blk, return_index=True)
    dups = np.setdiff1d(np.arange(len(pair_blk)), first, assume_unique=True)
    q_owner, row_grid, grid = [], [], np.full(n * maxblk, -1, dtype=np.int64)
    runs, row = [], 0
    breaks = np.flatnonzero(np.diff(uniq) > MAX_BLOCK_GAP + 1) + 1
    for a, b in zip(np.concatenate([[0], breaks]), np.concatenate([breaks, [len(uniq)]])):
        lo, hi = int(uniq[a]), int(uniq[b - 1]) + 1
        owner = np.full(hi - lo, n, dtype=np.int64)
        rg = np.zeros(hi - lo, dtype=np.int64)
        pairs = first[a:b]
        owner[uniq[a:b] - lo] = pair_seq[pairs]
        rg[uniq[a:b] - lo] = pair_grid[pairs]
        grid[pair_grid[pairs]] = row + uniq[a:b] - lo
        q_owner.append(np.where(owner == n, 0, owner))
        row_grid.append(rg)
        runs.append((row, lo, hi - lo))
        row += hi - lo
    dup_start = row
    if len(dups):
        q_owner.append(pair_seq[dups])
        row_grid.append(pair_grid[dups])
        grid[pair_grid[dups]] = row + np.arange(len(dups))
        row += len(dups)
    grid[grid < 0] = row  # padding: the zero row after the last
    pos = np.arange(maxblk * bs)
    allowed = pos[None, :] < lens[:, None]
    if win is not None:
        allowed &= pos[None, :] >= lens[:, None] - win  # the query sits at lens-1
    mask = np.where(allowed, 0.0, -np.inf).astype(np.float32)[:, None, None, :]
    cat = np.concatenate
    return _Decodes(
        tokens=dev(qsl[dec]),
        runs=runs,
        dup_blocks=dev(pair_blk[dups]) if len(dups) else None,
        dup_start=dup_start,
        num_rows=row,
        q_owner=dev(cat(q_owner)),
        grid=dev(grid),
        row_grid=dev(cat(row_grid)),
        max_blocks=maxblk,
        mask=dev(mask),
    )


def plan_torch_attention(
    plan: StepPlan, num_kv_heads: int, *, decodes: bool = True, write_rows: bool = True
) -> TorchAttentionPlan:
    """Indices and masks of the torch path for this step, built on the host.

    decodes=False skips planning the decodes (a decode kernel reads the cache itself);
    write_rows=False skips the rows of `write_kv` (a kernel writes the cache)."""
    bs, win = plan.block_size, plan.sliding_window
    slens, bt, qlens = plan.seq_lens_host, plan.block_tables_host, plan.query_lens_host
    qsl = plan.query_starts_host()
    device = plan.block_tables.device

    def dev(a):
        return torch.from_numpy(np.ascontiguousarray(a)).to(device)

    dec = np.flatnonzero(qlens == 1)
    planned = _plan_decodes(dec, slens, qsl, bt, bs, win, dev) if len(dec) and decodes else None

    prefills = []
    heads = np.arange(num_kv_heads)[:, None]
    for b in np.flatnonzero(qlens > 1):
        q, length = int(qlens[b]), int(slens[b])
        ctx = length - q
        start = int(qsl[b])
        mask = None
        if ctx > 0 or (win is not None and length > win):
            pos = np.arange(length)
            qpos = np.arange(ctx, length)[:, None]
            allowed = pos[None, :] <= qpos
            if win is not None:
                allowed &= pos[None, :] > qpos - win
            mask = dev(allowed)
        blocks = dev((bt[b, : -(-length // bs)][None, :] * num_kv_heads + heads).reshape(-1))
        prefills.append(_Prefill(start, start + q, blocks, length, mask, ctx == 0))
    rows = dev(_write_rows(plan.slot_mapping_host, bs, num_kv_heads)) if write_rows else None
    return TorchAttentionPlan(planned, prefills, rows)


def _decode_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, p: _Decodes, scale: float
) -> torch.Tensor:
    """q [n, Hkv, G, D] (one token per sequence) -> [n, Hkv, G, D]."""
    n, hkv, g, d = q.shape
    bs = k_cache.shape[2]
    dtype = q.dtype
    # one query per row of work (a block): [rows, Hkv, G, D]
    qrows = (q * scale).index_select(0, p.q_owner)
    k_dup = v_dup = None
    if p.dup_blocks is not None:
        k_dup, v_dup = k_cache.index_select(0, p.dup_blocks), v_cache.index_select(0, p.dup_blocks)

    def per_block(a: torch.Tensor, cache: torch.Tensor, dup, transpose: bool) -> torch.Tensor:
        """a [rows, Hkv, G, x] @ each row's block of `cache` (transposed: scores q @ K^T; else
        outputs p @ V) -> [rows + 1, Hkv, G, bs or D], the last row zeros (what `grid` padding
        reads)"""
        width = bs if transpose else d
        out = a.new_empty(p.num_rows + 1, hkv, g, width)
        out[p.num_rows].zero_()
        for row, lo, count in p.runs + (
            [(p.dup_start, None, dup.shape[0])] if dup is not None else []
        ):
            blocks = (cache[lo : lo + count] if lo is not None else dup).view(count * hkv, bs, d)
            torch.bmm(
                a[row : row + count].view(count * hkv, g, -1),
                blocks.transpose(1, 2) if transpose else blocks,
                out=out[row : row + count].view(count * hkv, g, width),
            )
        return out

    scores = per_block(qrows, k_cache, k_dup, transpose=True)  # [rows, Hkv, G, bs]
    # per sequence: [n, Hkv, G, maxblk * bs], softmax in float32
    s = scores.index_select(0, p.grid).view(n, p.max_blocks, hkv, g, bs).permute(0, 2, 3, 1, 4)
    s = s.reshape(n, hkv, g, p.max_blocks * bs).float()
    probs = torch.softmax(s.add_(p.mask), dim=-1).to(dtype)
    probs = (
        probs.view(n, hkv, g, p.max_blocks, bs)
        .permute(0, 3, 1, 2, 4)
        .reshape(n * p.max_blocks, hkv, g, bs)
    )
    partial = per_block(
        probs.index_select(0, p.row_grid), v_cache, v_dup, transpose=False
    )  # [rows, Hkv, G, D]
    # Each sequence's blocks side by side, padding reading the zero row, summed. (Not index_add_
    # by owner: on the CPU it runs ~4x slower in a thread other than the main one, where the
    # pipeline's runner steps the engine.)
    acc = torch.float32 if dtype in (torch.bfloat16, torch.float16) else dtype
    parts = partial.index_select(0, p.grid).view(n, p.max_blocks, hkv, g, d)
    return parts.sum(dim=1, dtype=acc).to(dtype)


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    plan: StepPlan,
    scale: float,
    k: torch.Tensor | None = None,
    v: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [T, Hq, D] -> out [T, Hq, D]; token i of seq b attends to its context positions <= its own.

    k, v [T, Hkv, D]: this step's new keys and values (already written to the cache); optional,
    they spare reading back a prefill chunk that starts its sequence."""
    t, hq, d = q.shape
    _, hkv, bs, _ = k_cache.shape
    torch_plan = _torch_plan(plan)
    group = hq // hkv
    out = torch.empty_like(q)

    if torch_plan.decodes is not None:
        p = torch_plan.decodes
        # GQA without repeating K/V: the `group` query heads sharing a KV head become its queries
        qd = q.index_select(0, p.tokens).view(-1, hkv, group, d)
        o = _decode_attention(qd, k_cache, v_cache, p, scale)
        out.index_copy_(0, p.tokens, o.view(-1, hq, d))

    prefill_attention(q, k_cache, v_cache, torch_plan.prefills, out, scale, k, v)
    return out


def prefill_attention(
    q, k_cache, v_cache, prefills: list[_Prefill], out, scale: float, k=None, v=None
) -> None:
    """Each prefill chunk through SDPA, into `out` (its own K/V when it starts its sequence)."""
    t, hq, d = q.shape
    _, hkv, bs, _ = k_cache.shape
    group = hq // hkv
    kblocks, vblocks = k_cache.view(-1, bs * d), v_cache.view(-1, bs * d)
    for p in prefills:
        qi = q[p.start : p.end].transpose(0, 1)  # [Hq, Lq, D]
        if p.start_of_seq and k is not None:  # no context: attend to this step's own K/V
            ki, vi = k[p.start : p.end].transpose(0, 1), v[p.start : p.end].transpose(0, 1)
        else:
            ki = kblocks.index_select(0, p.blocks).view(hkv, -1, d)[:, : p.length]
            vi = vblocks.index_select(0, p.blocks).view(hkv, -1, d)[:, : p.length]
        o = F.scaled_dot_product_attention(
            qi,
            ki,
            vi,
            attn_mask=p.mask,
            is_causal=p.mask is None,
            scale=scale,
            enable_gqa=group > 1,
        )
        out[p.start : p.end] = o.transpose(0, 1)
