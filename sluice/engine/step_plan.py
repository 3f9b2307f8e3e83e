"""One forward step's plan: where each new token of the flat batch sits, and what the kernels
precompute for it. The model runner builds it once a step; every layer only reads it.

Building it takes two moves:

1. `build_step_plan` lays the step out: the position and cache slot of every new token, each
   sequence's context length and block table, on the device and as host (numpy) copies, so that
   planning never waits on the device;
2. the kernel family adds what its attention kernels need (`KernelOps.plan`): decode and prefill
   rows for the C and Triton kernels, the torch path's block runs and masks, a compacted block
   table for a quantized cache.

`AttentionSpec` holds what decides which kernels serve a model's attention; it is fixed for an
engine, so the family decides once what to precompute.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from .config import ModelConfig
    from .paged_cache import LayerKVCache

QUANTIZED_CACHE_DTYPES = (torch.int8, torch.float8_e4m3fn)


@dataclass(frozen=True)
class AttentionSpec:
    """The types and shapes of a model's attention and its KV cache."""

    dtype: torch.dtype  # of the queries (the model dtype)
    cache_dtype: torch.dtype
    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    device_type: str = "cpu"

    @classmethod
    def of(cls, config: ModelConfig, dtype: torch.dtype, cache: LayerKVCache) -> AttentionSpec:
        """The spec of a model of `config` in `dtype` over one layer's `cache`."""
        return cls(
            dtype=dtype,
            cache_dtype=cache.k.dtype,
            num_heads=config.num_attention_heads,
            num_kv_heads=config.num_key_value_heads,
            head_dim=config.head_dim,
            block_size=cache.k.shape[2],
            device_type=cache.k.device.type,
        )

    @property
    def quantized_cache(self) -> bool:
        return self.cache_dtype in QUANTIZED_CACHE_DTYPES


@dataclass(frozen=True)
class DecodeRows:
    """The step's decodes (one new token each), as the decode kernels take them."""

    tokens: torch.Tensor  # [n] int64 flat-batch index of each decode token
    block_tables: torch.Tensor  # [n, max_blocks] int32
    seq_lens: torch.Tensor  # [n] int32
    max_seq_len: int  # known on the host: the kernel need not read it back from the device


@dataclass(frozen=True)
class PrefillRows:
    """The step's prefill chunks (more than one new token), for the CPU prefill kernel (host)."""

    starts: torch.Tensor  # [n] int64 first flat-batch row of each chunk
    q_lens: torch.Tensor  # [n] int32
    seq_lens: torch.Tensor  # [n] int32 context length after this step
    block_tables: torch.Tensor  # [n, max_blocks] int32


@dataclass(frozen=True)
class CompactCache:
    """The cache blocks some sequences read this step, for a dequantized copy of just those:
    `plan` is the step with block tables renumbered into 0..len(ids)-1 (the other sequences'
    tables point at block 0 and are not to be read)."""

    ids: torch.Tensor  # [U] cache blocks, ascending
    plan: StepPlan


@dataclass(frozen=True)
class StepPlan:
    # The flat batch, on the device.
    positions: torch.Tensor  # [T] position of each new token in its sequence
    slot_mapping: torch.Tensor  # [T] cache slot of each new token
    query_start_loc: torch.Tensor  # [B+1] offsets of each sequence's new tokens
    seq_lens: torch.Tensor  # [B] context length after this step (computed + new)
    block_tables: torch.Tensor  # [B, max_blocks] padded with 0
    max_seq_len: int
    block_size: int
    sliding_window: int | None
    # The same, on the host.
    query_lens_host: np.ndarray  # [B]
    seq_lens_host: np.ndarray  # [B]
    block_tables_host: np.ndarray  # [B, max_blocks]
    slot_mapping_host: np.ndarray  # [T]
    # Added by the kernel family (`KernelOps.plan`); None where it uses no such thing.
    attention: AttentionSpec | None = None  # what the step was planned for
    decodes: DecodeRows | None = None
    prefills: PrefillRows | None = None
    # the torch path's `attention.TorchAttentionPlan` (opaque here: that module builds on this one)
    torch_attention: object | None = None
    compact: CompactCache | None = None
    # The same step planned for each other window some layers attend with (Gemma 3's global
    # layers beside its local ones: `ModelConfig.layer_windows`), by window.
    other_windows: Mapping[int | None, StepPlan] = field(
        default_factory=lambda: MappingProxyType({})
    )

    def for_window(self, window: int | None) -> StepPlan:
        """The step as planned for a layer that attends with `window`."""
        if window == self.sliding_window:
            return self
        return self.other_windows[window]

    @property
    def spec(self) -> AttentionSpec:
        """What the step was planned for, by `KernelOps.plan`."""
        if self.attention is None:
            raise ValueError("the step was not planned by a kernel family (KernelOps.plan)")
        return self.attention

    def query_starts_host(self) -> np.ndarray:
        """[B+1] offsets of each sequence's new tokens in the flat batch, on the host."""
        return np.concatenate([[0], np.cumsum(self.query_lens_host)])


def build_step_plan(
    query_lens: list[int],
    seq_lens: list[int],
    block_tables: list[list[int]],
    block_size: int,
    device: torch.device | str = "cpu",
    sliding_window: int | None = None,
) -> StepPlan:
    """The layout of a flat batch: sequence b adds query_lens[b] tokens ending at position
    seq_lens[b] - 1.

    Index arithmetic runs in numpy on the host (tiny arrays; torch's per-op overhead and its slow
    1-D advanced indexing cost more here), then moves to `device` once."""
    b = len(query_lens)
    qlens = np.asarray(query_lens, dtype=np.int64).reshape(b)
    slens = np.asarray(seq_lens, dtype=np.int64).reshape(b)
    width = max((len(t) for t in block_tables), default=0) or 1
    bt = np.zeros((b, width), dtype=np.int64)
    for i, t in enumerate(block_tables):
        bt[i, : len(t)] = t
    qsl = np.zeros(b + 1, dtype=np.int64)
    np.cumsum(qlens, out=qsl[1:])
    decodes_only = bool((qlens == 1).all())
    if decodes_only:  # one new token a sequence: token i is sequence i's
        pos = slens - 1
        slots = bt[np.arange(b), pos // block_size] * block_size + pos % block_size
    else:
        seq_of_tok = np.repeat(np.arange(b), qlens)
        pos = np.arange(qsl[-1]) - qsl[:-1][seq_of_tok] + (slens - qlens)[seq_of_tok]
        slots = bt[seq_of_tok, pos // block_size] * block_size + pos % block_size
    device = torch.device(device)

    def dev(a):
        return _on(torch.from_numpy(a), device)

    return StepPlan(
        positions=dev(pos),
        slot_mapping=dev(slots),
        query_start_loc=dev(qsl),
        seq_lens=dev(slens),
        block_tables=dev(bt),
        max_seq_len=int(slens.max()) if b else 0,
        block_size=block_size,
        sliding_window=sliding_window,
        query_lens_host=qlens,
        seq_lens_host=slens,
        block_tables_host=bt,
        slot_mapping_host=slots,
    )


def _on(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """t (on the CPU) on `device`; on the CPU itself without a call into torch's dispatcher."""
    return t if device.type == "cpu" else t.to(device)


def decode_rows(plan: StepPlan) -> DecodeRows | None:
    """The step's decodes for a decode kernel (on the plan's device), or None if it has none."""
    qlens = plan.query_lens_host
    tables, lens = plan.block_tables_host, plan.seq_lens_host
    device = plan.block_tables.device

    def dev(a, dtype):
        return _on(torch.from_numpy(np.ascontiguousarray(a, dtype=dtype)), device)

    if len(qlens) and (qlens == 1).all():  # decodes only: row i is token i
        return DecodeRows(
            dev(np.arange(len(qlens)), np.int64),
            dev(tables, np.int32),
            dev(lens, np.int32),
            int(lens.max()),
        )
    dec = np.flatnonzero(qlens == 1)
    if not len(dec):
        return None
    qsl = plan.query_starts_host()
    return DecodeRows(
        dev(qsl[dec], np.int64),
        dev(tables[dec], np.int32),
        dev(lens[dec], np.int32),
        int(lens[dec].max()),
    )


def token_rows(plan: StepPlan) -> DecodeRows | None:
    """Every new token of the step as a decode row of its own: its sequence's block table and
    its position + 1 as context length (a prefill chunk's token then attends exactly as it
    would as a decode)."""
    qlens = plan.query_lens_host
    if not qlens.sum():
        return None
    seq_of_tok = np.repeat(np.arange(len(qlens)), qlens)
    qsl = plan.query_starts_host()
    lens = plan.seq_lens_host[seq_of_tok] - qlens[seq_of_tok] + np.arange(qsl[-1])
    lens = lens - qsl[:-1][seq_of_tok] + 1
    device = plan.block_tables.device

    def dev(a, dtype):
        return torch.from_numpy(np.ascontiguousarray(a)).to(device=device, dtype=dtype)

    return DecodeRows(
        dev(np.arange(qsl[-1]), torch.long),
        dev(plan.block_tables_host[seq_of_tok], torch.int32),
        dev(lens, torch.int32),
        int(lens.max()),
    )


def prefill_rows(plan: StepPlan, min_query_len: int = 2) -> PrefillRows | None:
    """The step's prefill chunks for the CPU prefill kernel, or None if it has none; with
    `min_query_len` 1, its decodes too, as chunks of one token."""
    qlens = plan.query_lens_host
    chunks = np.flatnonzero(qlens >= min_query_len)
    if not len(chunks):
        return None
    qsl = plan.query_starts_host()
    tables, lens = plan.block_tables_host, plan.seq_lens_host

    def host(a, dtype):
        return torch.from_numpy(np.ascontiguousarray(a)).to(dtype=dtype)

    return PrefillRows(
        host(qsl[chunks], torch.long),
        host(qlens[chunks], torch.int32),
        host(lens[chunks], torch.int32),
        host(tables[chunks], torch.int32),
    )


def compact_cache(plan: StepPlan, seqs: np.ndarray | None) -> CompactCache:
    """The blocks that sequences `seqs` (None: all) read this step, and the plan renumbered to
    index them in a compact cache."""
    bs = plan.block_size
    tables, lens = plan.block_tables_host, plan.seq_lens_host
    used = np.arange(tables.shape[1])[None, :] < (-(-lens // bs))[:, None]  # [B, max_blocks]
    if seqs is not None:
        keep = np.zeros(len(lens), dtype=bool)
        keep[seqs] = True
        used &= keep[:, None]
    ids = np.unique(tables[used])
    renumbered = np.where(used, np.searchsorted(ids, tables), 0)
    device = plan.block_tables.device
    compact = replace(
        plan,
        block_tables=torch.from_numpy(renumbered).to(device),
        block_tables_host=renumbered,
        attention=None,
        decodes=None,
        prefills=None,
        torch_attention=None,
        compact=None,
    )
    return CompactCache(ids=torch.from_numpy(ids).to(device), plan=compact)
