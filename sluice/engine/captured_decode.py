"""Steps of decodes captured once per batch size as CUDA graphs and replayed
(`EngineConfig.cuda_graphs`, `--cuda-graphs`).

A decode step of a small batch on a GPU is bound by launching its kernels (about ten a layer,
each a few microseconds of host work), not by the bytes they read. Captured, the whole step from
token ids to logits is one graph launch. vLLM and SGLang do the same by default.

A graph replays fixed kernels on fixed memory, so:

- its inputs are static buffers the step's values are copied into: token ids, positions, cache
  slots, context lengths and block tables as wide as the longest context the engine allows;
- it is captured for a few batch sizes (`decode_buckets`); a step of n decodes replays the
  smallest that holds n, its other rows padding: token 0 at position 0, whose KV write is skipped
  (slot -1, as the KV kernels skip it) and whose attention reads one cached token of block 0; their
  logits are dropped;
- the attention's partitions per sequence are chosen at capture for the longest context
  (`paged_attention.choose_num_splits`); the kernel cuts each sequence's own context by them.

Only the triton family is captured (`ModelRunner` asks for it); steps with prefill chunks, and
decode steps larger than the largest bucket, run eagerly. With `capture=False` the same static
buffers and padding run eagerly: what the CPU tests check, under Triton's interpreter, where
there is nothing to capture.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import replace

import numpy as np
import torch

from .model import CausalLM
from .paged_cache import LayerKVCache
from .step_plan import AttentionSpec, DecodeRows, StepPlan

log = logging.getLogger("sluice.engine")

# Batch sizes captured: 1, 2, 4, then multiples of 8 to 64, then of 32: a step pads at most 7
# rows up to 64 sequences (where it is bound by launches, not rows) and at most a third of its
# rows beyond, and the graphs stay few (they capture in seconds).
LARGEST_BUCKET = 256


def decode_buckets(max_num_seqs: int) -> list[int]:
    """The batch sizes captured for an engine of at most `max_num_seqs` sequences a step."""
    top = max(1, min(max_num_seqs, LARGEST_BUCKET))
    sizes = [1, 2, 4] + list(range(8, 65, 8)) + list(range(96, LARGEST_BUCKET + 1, 32))
    return sorted({s for s in sizes if s < top} | {top})


class CapturedDecode:
    """A model's decode step from token ids to float32 logits, captured per batch size."""

    def __init__(
        self,
        model: CausalLM,
        spec: AttentionSpec,
        caches: Sequence[LayerKVCache],
        max_num_seqs: int,
        max_model_len: int,
        capture: bool = True,
    ):
        self.model = model
        self.spec = spec
        self.caches = list(caches)
        self.block_size = spec.block_size
        self.buckets = decode_buckets(max_num_seqs)
        self.max_model_len = max_model_len
        self.capture = capture
        self.replays = 0  # steps served (tests check the path was taken)
        rows = self.buckets[-1]
        width = -(-max_model_len // self.block_size)
        device = model.device

        def buffer(shape, dtype):
            return torch.zeros(shape, dtype=dtype, device=device)

        self.token_ids = buffer(rows, torch.long)
        self.positions = buffer(rows, torch.long)
        self.slots = buffer(rows, torch.long)
        self.seq_lens = buffer(rows, torch.int32)
        self.block_tables = buffer((rows, width), torch.int32)
        self.row_ids = torch.arange(rows, dtype=torch.long, device=device)
        self.starts = torch.arange(rows + 1, dtype=torch.long, device=device)
        # Host copies of the step's rows, copied over in one go each.
        self._host: dict[str, np.ndarray] = {
            "token_ids": np.zeros(rows, np.int64),
            "positions": np.zeros(rows, np.int64),
            "slots": np.full(rows, -1, np.int64),
            "seq_lens": np.ones(rows, np.int32),
        }
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._outputs: dict[int, torch.Tensor] = {}
        if capture:
            self._capture_all()

    def logits(
        self,
        token_ids: Sequence[int],
        seq_lens: Sequence[int],
        block_tables: Sequence[Sequence[int]],
    ) -> torch.Tensor | None:
        """Float32 logits [n, V] of a step of n decodes (sequence i's new token token_ids[i],
        its context seq_lens[i] tokens in blocks block_tables[i]); None where n is larger than
        every bucket (the caller runs the step eagerly)."""
        n = len(token_ids)
        bucket = next((b for b in self.buckets if b >= n), None)
        if bucket is None:
            return None
        self._fill(token_ids, seq_lens, block_tables, bucket)
        if self.capture:
            self._graphs[bucket].replay()
            out = self._outputs[bucket]
        else:
            out = self._run(bucket)
        self.replays += 1
        # the next replay overwrites the graph's output: the caller gets its own copy
        return out[:n].clone()

    def _fill(self, token_ids, seq_lens, block_tables, bucket: int) -> None:
        """The step's rows into the static buffers, the rows after them up to `bucket` padding.
        Of the block tables only the columns this step's contexts reach are written: the kernels
        read no entry past a context's end, so older values there are never seen."""
        n, h, bs = len(token_ids), self._host, self.block_size
        lens = np.asarray(seq_lens, dtype=np.int64)
        cols = max((len(t) for t in block_tables), default=1) or 1
        tables = np.zeros((bucket, cols), np.int32)  # padding rows: block 0, one token of it
        for i, table in enumerate(block_tables):
            tables[i, : len(table)] = table
        h["token_ids"][:n] = token_ids
        h["positions"][:n] = lens - 1
        h["seq_lens"][:n] = lens
        last = (lens - 1) // bs
        h["slots"][:n] = tables[np.arange(n), last].astype(np.int64) * bs + (lens - 1) % bs
        h["token_ids"][n:bucket] = 0
        h["positions"][n:bucket] = 0
        h["seq_lens"][n:bucket] = 1
        h["slots"][n:bucket] = -1  # the KV write skips the row
        for name in ("token_ids", "positions", "slots", "seq_lens"):
            getattr(self, name)[:bucket].copy_(torch.from_numpy(h[name][:bucket]))
        self.block_tables[:bucket, :cols].copy_(torch.from_numpy(tables))

    def _plan(self, bucket: int) -> StepPlan:
        """A step of `bucket` decodes over the static buffers, as the triton family plans it
        (its decode rows are the same whatever window a layer attends with)."""
        ones = np.ones(bucket, np.int64)
        plan = StepPlan(
            positions=self.positions[:bucket],
            slot_mapping=self.slots[:bucket],
            query_start_loc=self.starts[: bucket + 1],
            seq_lens=self.seq_lens[:bucket],
            block_tables=self.block_tables[:bucket],
            max_seq_len=self.max_model_len,
            block_size=self.block_size,
            sliding_window=self.model.config.sliding_window,
            # (the host copies describe the captured shape; no kernel of the family reads them)
            query_lens_host=ones,
            seq_lens_host=ones,
            block_tables_host=np.zeros((bucket, 1), np.int64),
            slot_mapping_host=-ones,
            attention=self.spec,
            decodes=DecodeRows(
                tokens=self.row_ids[:bucket],
                block_tables=self.block_tables[:bucket],
                seq_lens=self.seq_lens[:bucket],
                # the partitions are chosen for the longest context the engine allows
                max_seq_len=self.max_model_len,
            ),
        )
        others = {w: replace(plan, sliding_window=w) for w in self.model.config.other_windows}
        return replace(plan, other_windows=others) if others else plan

    @torch.inference_mode()
    def _run(self, bucket: int) -> torch.Tensor:
        """The step over the static buffers: what is captured."""
        model = self.model
        x = model.embed_tokens(self.token_ids[:bucket])
        hidden = model.forward_embedded(x, self._plan(bucket), self.caches)
        return model.compute_logits(hidden)

    @torch.inference_mode()
    def _capture_all(self) -> None:
        """A graph per bucket, the largest first (the others reuse its memory pool)."""
        started = time.monotonic()
        pool = torch.cuda.graph_pool_handle()
        for bucket in reversed(self.buckets):
            self._fill([], [], [], bucket)  # all padding: nothing is written to the cache
            self._run(bucket)  # compiles the kernels and lets the libraries pick theirs
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._outputs[bucket] = self._run(bucket)
            self._graphs[bucket] = graph
        torch.cuda.synchronize()
        log.info(
            "CUDA graphs: decode steps of %s sequences captured in %.1f s",
            ",".join(map(str, self.buckets)),
            time.monotonic() - started,
        )
