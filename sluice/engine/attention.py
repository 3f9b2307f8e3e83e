"""Paged attention over a flat batch: metadata, KV-cache writes, and the torch implementation.

One forward step carries the new tokens of many sequences back to back (decodes and prefill
chunks mixed). Each layer writes its new K/V into the paged cache through `slot_mapping`, then
every new token attends to its sequence's whole context, read back through the block table.

The torch path plans once per step (`TorchPlan`, cached on the metadata and shared by all layers):
decodes (one new token) run as one padded batch with a key-padding mask; each prefill chunk runs
on its own with a causal mask shifted by the tokens already in the cache (or `is_causal` when the
chunk is the start of its sequence), so no query is ever padded.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] cache slot of each new token of the flat batch
    query_start_loc: torch.Tensor  # [B+1] offsets of each seq's new tokens in the flat batch
    seq_lens: torch.Tensor  # [B] context length after this step (computed + new)
    block_tables: torch.Tensor  # [B, max_blocks] padded with 0
    max_seq_len: int
    # Optional helpers. Host (numpy) copies let the torch path plan without device syncs.
    positions: torch.Tensor | None = None  # [T] position of each new token in its sequence
    query_lens_host: np.ndarray | None = None
    seq_lens_host: np.ndarray | None = None
    block_tables_host: np.ndarray | None = None
    block_size: int | None = None
    sliding_window: int | None = None
    torch_plan: "TorchPlan | None" = field(default=None, repr=False)

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]


def build_metadata(
    query_lens: list[int],
    seq_lens: list[int],
    block_tables: list[list[int]],
    block_size: int,
    device: torch.device | str = "cpu",
    sliding_window: int | None = None,
) -> AttentionMetadata:
    """Metadata for a flat batch: seq b adds query_lens[b] tokens ending at position seq_lens[b]-1.

    Index arithmetic runs in numpy on the host (tiny arrays; torch's per-op overhead and its slow
    1-D advanced indexing cost more here), then moves to `device` once."""
    b = len(query_lens)
    qlens = np.asarray(query_lens, dtype=np.int64).reshape(b)
    slens = np.asarray(seq_lens, dtype=np.int64).reshape(b)
    bt = np.zeros((b, max((len(t) for t in block_tables), default=0) or 1), dtype=np.int64)
    for i, t in enumerate(block_tables):
        bt[i, : len(t)] = t
    qsl = np.zeros(b + 1, dtype=np.int64)
    np.cumsum(qlens, out=qsl[1:])
    seq_of_tok = np.repeat(np.arange(b), qlens)
    pos = np.arange(qsl[-1]) - qsl[:-1][seq_of_tok] + (slens - qlens)[seq_of_tok]
    slots = bt[seq_of_tok, pos // block_size] * block_size + pos % block_size

    def dev(a):
        return torch.from_numpy(a).to(device)

    return AttentionMetadata(
        slot_mapping=dev(slots),
        query_start_loc=dev(qsl),
        seq_lens=dev(slens),
        block_tables=dev(bt),
        max_seq_len=int(slens.max()) if b else 0,
        positions=dev(pos),
        query_lens_host=qlens,
        seq_lens_host=slens,
        block_tables_host=bt,
        block_size=block_size,
        sliding_window=sliding_window,
    )


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """k, v [T, Hkv, D] -> the cache slots of `slot_mapping` (cache [num_blocks, block_size, Hkv, D])."""
    hkv, d = k_cache.shape[-2:]
    k_cache.view(-1, hkv, d).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, hkv, d).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


# The torch path reads K/V with one index_select over rows of D values of the cache viewed as
# [num_slots * Hkv, D]: row = slot * Hkv + head. Gathering head-major gives SDPA contiguous
# [.., Hkv, L, D] operands with no transpose copy (measured: plain advanced indexing `cache[idx]`
# with a 1-D index is ~1000x slower than index_select on this torch build). Decode gathers go
# into two buffers reused by every layer of the step: a fresh multi-MB tensor per layer costs page
# faults that made the gather 4x slower (SmolLM2, batch 64, 256-token contexts).


@dataclass
class _Prefill:
    start: int  # first token in the flat batch
    end: int
    rows: torch.Tensor  # [Hkv * L] cache rows of the seq's context positions 0..L-1, head-major
    length: int  # L
    mask: torch.Tensor | None  # [Lq, L] bool (True = attend), None -> plain causal


@dataclass
class TorchPlan:
    dec_tokens: torch.Tensor | None  # [Bd] flat-batch index of each decode token
    dec_rows: torch.Tensor | None  # [Bd * Hkv * Lmax] cache rows of each decode seq's context (padded)
    dec_len: int  # Lmax
    dec_mask: torch.Tensor | None  # [Bd, 1, 1, Lmax] bool, None when no padding is needed
    prefills: list[_Prefill]
    dec_buffers: tuple[torch.Tensor, torch.Tensor] | None = None  # gathered K/V, reused by every layer


def _head_rows(slots: np.ndarray, num_kv_heads: int) -> np.ndarray:
    """[..., L] slots -> [..., Hkv, L] rows of the [num_slots * Hkv, D] cache view, flattened."""
    heads = np.arange(num_kv_heads)[:, None]
    return (slots[..., None, :] * num_kv_heads + heads).reshape(-1)


def plan_torch(meta: AttentionMetadata, num_kv_heads: int) -> TorchPlan:
    """Gather indices and masks for this step, built once on the host and cached on `meta`."""
    if meta.torch_plan is not None:
        return meta.torch_plan
    bs, win = meta.block_size, meta.sliding_window
    if bs is None:
        raise ValueError("AttentionMetadata.block_size is needed by the torch attention path")
    host = lambda t, h: h if h is not None else t.cpu().numpy()  # noqa: E731
    slens = host(meta.seq_lens, meta.seq_lens_host)
    qsl = host(meta.query_start_loc, None) if meta.query_lens_host is None else None
    qlens = meta.query_lens_host if qsl is None else np.diff(qsl)
    if qsl is None:
        qsl = np.concatenate([[0], np.cumsum(qlens)])
    bt = host(meta.block_tables, meta.block_tables_host)
    device = meta.block_tables.device

    def dev(a):
        return torch.from_numpy(np.ascontiguousarray(a)).to(device)

    dec = np.flatnonzero(qlens == 1)
    dec_tokens = dec_rows = dec_mask = None
    lmax = 0
    if len(dec):
        lens = slens[dec]
        lmax = int(lens.max())
        pos = np.arange(lmax)
        dec_slots = bt[dec][:, pos // bs] * bs + pos % bs
        dec_tokens, dec_rows = dev(qsl[dec]), dev(_head_rows(dec_slots, num_kv_heads))
        if (lens != lmax).any() or (win is not None and lmax > win):
            m = pos[None, :] < lens[:, None]
            if win is not None:
                m &= pos[None, :] >= lens[:, None] - win  # the query sits at lens-1
            dec_mask = dev(m[:, None, None, :])

    prefills = []
    for b in np.flatnonzero(qlens > 1):
        q, length = int(qlens[b]), int(slens[b])
        ctx = length - q
        pos = np.arange(length)
        slots = bt[b, pos // bs] * bs + pos % bs
        mask = None
        if ctx > 0 or (win is not None and length > win):
            qpos = np.arange(ctx, length)[:, None]
            mask = pos[None, :] <= qpos
            if win is not None:
                mask &= pos[None, :] > qpos - win
            mask = dev(mask)
        start = int(qsl[b])
        prefills.append(_Prefill(start, start + q, dev(_head_rows(slots, num_kv_heads)), length, mask))
    meta.torch_plan = TorchPlan(dec_tokens, dec_rows, lmax, dec_mask, prefills)
    return meta.torch_plan


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """q [T, Hq, D] -> out [T, Hq, D]; token i of seq b attends to its context positions <= its own."""
    t, hq, d = q.shape
    hkv = k_cache.shape[-2]
    plan = plan_torch(meta, hkv)
    group = hq // hkv
    krows, vrows = k_cache.view(-1, d), v_cache.view(-1, d)
    out = torch.empty_like(q)

    if plan.dec_tokens is not None:
        bd, lmax = plan.dec_tokens.shape[0], plan.dec_len
        # GQA without repeating K/V: the `group` query heads sharing a KV head become its queries
        qd = q.index_select(0, plan.dec_tokens).view(bd, hkv, group, d)
        if plan.dec_buffers is None or plan.dec_buffers[0].dtype != k_cache.dtype:
            plan.dec_buffers = tuple(k_cache.new_empty(plan.dec_rows.shape[0], d) for _ in range(2))
        kbuf, vbuf = plan.dec_buffers
        k = torch.index_select(krows, 0, plan.dec_rows, out=kbuf).view(bd, hkv, lmax, d)
        v = torch.index_select(vrows, 0, plan.dec_rows, out=vbuf).view(bd, hkv, lmax, d)
        o = F.scaled_dot_product_attention(qd, k, v, attn_mask=plan.dec_mask, scale=scale)
        out.index_copy_(0, plan.dec_tokens, o.reshape(bd, hq, d))

    for p in plan.prefills:
        qi = q[p.start : p.end].transpose(0, 1)  # [Hq, Lq, D]
        k = krows.index_select(0, p.rows).view(hkv, p.length, d)
        v = vrows.index_select(0, p.rows).view(hkv, p.length, d)
        o = F.scaled_dot_product_attention(
            qi, k, v, attn_mask=p.mask, is_causal=p.mask is None, scale=scale, enable_gqa=group > 1
        )
        out[p.start : p.end] = o.transpose(0, 1)
    return out
