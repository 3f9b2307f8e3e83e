"""A layer's attention step: write this step's K/V into its cache, then attend, on each path.

torch: `attention.write_kv` and `attention.paged_attention` on a cache in the model dtype. A
quantized cache is written by `kernels.kv_cache.write_kv_torch`, and the blocks this step reads are
dequantized into a compact temporary cache (block tables renumbered to match), so the same
attention code runs on it.

native (the CPU default where it builds): the cache write, decodes and prefill chunks through the
C kernels of `cpu_kernels` (float32 or bfloat16 models, on a cache of the model's type or an int8
one, read directly).

triton (the CUDA default): the cache write and the decode attention are Triton kernels that read
a quantized cache directly; prefill chunks still go through SDPA (on a dequantized copy of their
blocks when the cache is quantized).

What each step needs beyond `AttentionMetadata` (renumbered tables, decode rows) is computed once
on the host and cached on the metadata, shared by all layers.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch

from .attention import AttentionMetadata, _prefill_attention, paged_attention, plan_torch, write_kv
from .paged_cache import LayerKVCache


@dataclass
class _Compact:
    ids: torch.Tensor  # [U] cache blocks the step reads, ascending
    meta: AttentionMetadata  # the step's metadata with block tables renumbered into 0..U-1


@dataclass
class _PrefillRows:
    """The step's prefill chunks (more than one new token) for the native kernel, on the host."""
    starts: torch.Tensor  # [n] int64 first flat-batch row of each chunk
    q_lens: torch.Tensor  # [n] int32
    seq_lens: torch.Tensor  # [n] int32 context length after this step
    block_tables: torch.Tensor  # [n, max_blocks] int32


@dataclass
class _DecodeRows:
    tokens: torch.Tensor  # [n] flat-batch index of each decode token
    block_tables: torch.Tensor  # [n, max_blocks] int32
    seq_lens: torch.Tensor  # [n] int32
    max_seq_len: int  # known on the host: the kernel need not read it back from the device


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: LayerKVCache, meta: AttentionMetadata,
           scale: float, kernels: str = "torch") -> torch.Tensor:
    """q [T, Hq, D], k/v [T, Hkv, D] of this step -> attention output [T, Hq, D].

    cache: a LayerKVCache, or a (k_cache, v_cache) pair in the model dtype."""
    if not isinstance(cache, LayerKVCache):
        cache = LayerKVCache(*cache)
    if kernels == "triton":
        from .kernels.kv_cache import write_kv_triton

        write_kv_triton(k, v, cache.k, cache.v, meta.slot_mapping, cache.k_scale, cache.v_scale)
        return _attend_triton(q, k, v, cache, meta, scale)
    if kernels == "native" and _native_serves(q, k, cache.k):
        from .cpu_kernels.kv_write import write_kv_native

        write_kv_native(k, v, cache.k, cache.v, meta.slot_mapping, cache.k_scale, cache.v_scale)
        return _attend_native(q, k, v, cache, meta, scale)
    if not cache.quantized:
        write_kv(k, v, cache.k, cache.v, meta)
        return paged_attention(q, cache.k, cache.v, meta, scale, k, v)
    from .kernels.kv_cache import write_kv_torch

    write_kv_torch(k, v, cache.k, cache.v, meta.slot_mapping, cache.k_scale, cache.v_scale)
    compact = _compact(meta, "_compact_all", None)
    kc, vc = _dequantize(cache, compact.ids, q.dtype)
    return paged_attention(q, kc, vc, compact.meta, scale, k, v)


def _attend_triton(q, k, v, cache: LayerKVCache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    from .kernels.paged_attention import paged_decode_attention_triton

    hkv = cache.k.shape[1]
    out = torch.empty_like(q)
    rows = _decode_rows(meta)
    if rows is not None:
        o = paged_decode_attention_triton(
            q.index_select(0, rows.tokens), cache.k, cache.v, rows.block_tables, rows.seq_lens, scale,
            cache.k_scale, cache.v_scale, meta.sliding_window, max_seq_len=rows.max_seq_len,
        )
        out.index_copy_(0, rows.tokens, o)
    _prefills_through_sdpa(q, k, v, cache, meta, out, scale)
    return out


def _prefills_through_sdpa(q, k, v, cache: LayerKVCache, meta: AttentionMetadata, out, scale: float) -> None:
    """The step's prefill chunks through SDPA into `out`, on a dequantized copy of their blocks
    when the cache is quantized."""
    hkv = cache.k.shape[1]
    prefills = plan_torch(meta, hkv, with_decodes=False).prefills
    if not prefills:
        return
    if cache.quantized:
        qlens = meta.query_lens()
        compact = _compact(meta, "_compact_prefills", np.flatnonzero(qlens > 1))
        kc, vc = _dequantize(cache, compact.ids, q.dtype)
        prefills = plan_torch(compact.meta, hkv, with_decodes=False).prefills
    else:
        kc, vc = cache.k, cache.v
    _prefill_attention(q, kc, vc, prefills, out, scale, k, v)


def _native_serves(q: torch.Tensor, k: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """The C kernels can write this cache and attend on it (`paged_decode.supports`, `kv_write.supports`)."""
    from .cpu_kernels import kv_write, paged_decode

    return paged_decode.supports(q, k_cache) and kv_write.supports(k, k_cache)


def _attend_native(q, k, v, cache: LayerKVCache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """Decodes and prefill chunks through the C kernels on the cache in place (an int8 one read
    directly); chunks through SDPA where the prefill kernel lacks the shape."""
    from .cpu_kernels import paged_prefill
    from .cpu_kernels.paged_decode import paged_decode_cpu

    out = torch.empty_like(q)
    rows = _decode_rows(meta)
    if rows is not None:
        paged_decode_cpu(q, out, rows.tokens, cache.k, cache.v, rows.block_tables, rows.seq_lens, scale,
                         meta.sliding_window, rows.max_seq_len, cache.k_scale, cache.v_scale)
    chunks = _prefill_rows(meta)
    if chunks is None:
        return out
    if paged_prefill.supports(q, cache.k):
        paged_prefill.paged_prefill_cpu(q, out, chunks.starts, chunks.q_lens, chunks.seq_lens, cache.k, cache.v,
                                        chunks.block_tables, scale, meta.sliding_window, cache.k_scale, cache.v_scale)
    else:
        _prefills_through_sdpa(q, k, v, cache, meta, out, scale)
    return out


def _dequantize(cache: LayerKVCache, ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    from .kernels.kv_cache import dequantize_torch

    return dequantize_torch(cache.k, cache.k_scale, ids, dtype), dequantize_torch(cache.v, cache.v_scale, ids, dtype)


def _compact(meta: AttentionMetadata, key: str, seqs: np.ndarray | None) -> _Compact:
    """The blocks that sequences `seqs` (None: all) read this step, and the metadata renumbered
    to index them in a compact cache (other sequences' tables point at block 0: not to be read)."""
    cached = getattr(meta, key, None)
    if cached is not None:
        return cached
    bs = meta.block_size
    tables, lens = meta.host("block_tables"), meta.host("seq_lens")
    used = np.arange(tables.shape[1])[None, :] < (-(-lens // bs))[:, None]  # [B, max_blocks]
    if seqs is not None:
        keep = np.zeros(len(lens), dtype=bool)
        keep[seqs] = True
        used &= keep[:, None]
    ids = np.unique(tables[used])
    renumbered = np.where(used, np.searchsorted(ids, tables), 0)
    device = meta.block_tables.device
    compact = _Compact(
        ids=torch.from_numpy(ids).to(device),
        meta=replace(meta, block_tables=torch.from_numpy(renumbered).to(device), block_tables_host=renumbered,
                     torch_plan=None),
    )
    setattr(meta, key, compact)
    return compact


def _prefill_rows(meta: AttentionMetadata) -> _PrefillRows | None:
    cached = getattr(meta, "_prefill_rows", False)
    if cached is not False:
        return cached
    qlens = meta.query_lens()
    chunks = np.flatnonzero(qlens > 1)
    rows = None
    if len(chunks):
        qsl = np.concatenate([[0], np.cumsum(qlens)])
        tables, lens = meta.host("block_tables"), meta.host("seq_lens")
        host = lambda a, t: torch.from_numpy(np.ascontiguousarray(a)).to(dtype=t)  # noqa: E731
        rows = _PrefillRows(host(qsl[chunks], torch.long), host(qlens[chunks], torch.int32),
                            host(lens[chunks], torch.int32), host(tables[chunks], torch.int32))
    meta._prefill_rows = rows
    return rows


def _decode_rows(meta: AttentionMetadata) -> _DecodeRows | None:
    cached = getattr(meta, "_decode_rows", False)
    if cached is not False:
        return cached
    qlens = meta.query_lens()
    dec = np.flatnonzero(qlens == 1)
    rows = None
    if len(dec):
        device = meta.block_tables.device
        qsl = np.concatenate([[0], np.cumsum(qlens)])
        tables, lens = meta.host("block_tables"), meta.host("seq_lens")
        dev = lambda a, t: torch.from_numpy(np.ascontiguousarray(a)).to(device=device, dtype=t)  # noqa: E731
        rows = _DecodeRows(dev(qsl[dec], torch.long), dev(tables[dec], torch.int32), dev(lens[dec], torch.int32),
                           int(lens[dec].max()))
    meta._decode_rows = rows
    return rows
