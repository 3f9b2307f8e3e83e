"""Turns a ScheduledBatch into a step plan and tensors, runs one forward over the flat batch,
returns logits. A step of decodes only goes from token ids to logits in one call where the kernel
family has one (`KernelOps.forward_decodes`), with the same bits, or as a replayed CUDA graph
where the engine captured them (`captured_decode`).

It owns the paged KV cache: per layer a `LayerKVCache`, K and V of [num_blocks, Hkv, block_size, D]
(`attention.kv_cache_shape`) in the model dtype, or quantized with per-block-and-head scales.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, replace

import torch

from .attention import kv_cache_shape
from .captured_decode import CapturedDecode
from .config import EngineConfig, ModelConfig
from .errors import ConfigError
from .model import CausalLM
from .page_reservation import reserve_in_background
from .paged_cache import LayerKVCache, bytes_per_block
from .step_plan import AttentionSpec, StepPlan, build_step_plan

# CPU default KV budget when EngineConfig.kv_cache_bytes is None: a fifth of the memory the OS
# reports available, kept between 256 MiB and 4 GiB (SmolLM2 in float32 needs 45 KiB per token,
# so 4 GiB holds ~93k tokens; weights and activations need the rest of the memory).
CPU_KV_FRACTION = 0.2
CPU_KV_MIN_BYTES = 256 << 20
CPU_KV_MAX_BYTES = 4 << 30


def _available_ram() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def kv_cache_budget(engine_config: EngineConfig) -> int:
    """Bytes for K+V of all layers: the configured budget, else a device-dependent default.

    CUDA: what is left when this process may use `gpu_memory_fraction` of the whole device and
    the weights are already loaded (vLLM's gpu_memory_utilization rule)."""
    if engine_config.kv_cache_bytes is not None:
        return int(engine_config.kv_cache_bytes)
    device = torch.device(engine_config.device)
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return int(free - total * (1.0 - engine_config.gpu_memory_fraction))
    return int(min(CPU_KV_MAX_BYTES, max(CPU_KV_MIN_BYTES, CPU_KV_FRACTION * _available_ram())))


def num_kv_blocks(model_config: ModelConfig, engine_config: EngineConfig) -> int:
    """Number of KV blocks that fit the budget (never more than max_num_seqs full-length seqs
    need)."""
    per_block = bytes_per_block(
        model_config, engine_config.block_size, engine_config.kv_torch_dtype
    )
    budget = kv_cache_budget(engine_config)
    n = budget // per_block
    max_len = engine_config.max_model_len or model_config.max_position_embeddings
    n = min(n, engine_config.max_num_seqs * math.ceil(max_len / engine_config.block_size))
    if n < 1:
        raise ConfigError(
            f"KV cache budget of {budget} bytes is smaller than one block ({per_block} bytes)",
            field="kv_cache_bytes",
        )
    return int(n)


@dataclass
class StepInputs:
    """What one forward takes from the batch scheduler (what every tensor-parallel rank is sent):
    the block copies to make first, then the new tokens of each sequence."""

    token_ids: list[int]  # the flat batch
    query_lens: list[int]  # per sequence: its new tokens
    seq_lens: list[int]  # per sequence: its context after this step
    block_tables: list[list[int]]  # per sequence: the blocks that context is in
    block_copies: list[tuple[int, int]]


class ModelRunner:
    def __init__(
        self, model: CausalLM, config: ModelConfig, engine_config: EngineConfig, num_blocks: int
    ):
        self.model = model
        self.config = config
        self.engine_config = engine_config
        self.block_size = engine_config.block_size
        self.num_blocks = num_blocks
        self.device = model.device
        shape = kv_cache_shape(
            num_blocks, self.block_size, config.num_key_value_heads, config.head_dim
        )
        kv_dtype = engine_config.kv_torch_dtype
        if kv_dtype == torch.float8_e4m3fn and self.device.type != "cuda":
            raise ConfigError(
                "kv_cache_dtype='fp8' needs a CUDA device; use 'int8' on the CPU",
                field="kv_cache_dtype",
            )
        self.kv_caches = [
            LayerKVCache.allocate(shape, kv_dtype, self.device)
            for _ in range(config.num_hidden_layers)
        ]
        self.attention = AttentionSpec.of(config, model.dtype, self.kv_caches[0])
        self.reserving = reserve_in_background([t for c in self.kv_caches for t in c.tensors()])
        # decode steps replayed from CUDA graphs (`captured_decode`), where configured
        self.captured: CapturedDecode | None = None
        if engine_config.cuda_graphs:
            self.captured = CapturedDecode(
                model,
                self.attention,
                self.kv_caches,
                engine_config.max_num_seqs,
                engine_config.max_model_len or config.max_position_embeddings,
            )

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy whole KV blocks src -> dst in every layer (copy-on-write of a shared last block)."""
        if not copies:
            return
        src = torch.tensor([s for s, _ in copies], device=self.device)
        dst = torch.tensor([d for _, d in copies], device=self.device)
        for cache in self.kv_caches:
            cache.copy_blocks(src, dst)

    def plan(
        self, query_lens: list[int], seq_lens: list[int], block_tables: list[list[int]]
    ) -> StepPlan:
        """The step's plan: its layout, and what the model's kernels precompute for it."""
        layout = build_step_plan(
            query_lens,
            seq_lens,
            block_tables,
            self.block_size,
            self.device,
            self.config.sliding_window,
        )
        return self.model.ops.plan(layout, self.attention)

    def step_inputs(self, batch) -> StepInputs:
        """The forward's inputs for a scheduled batch."""
        inputs = StepInputs([], [], [], [], list(batch.block_copies))
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            start = seq.num_computed_tokens
            inputs.token_ids += seq.token_ids[start : start + n]
            inputs.query_lens.append(n)
            inputs.seq_lens.append(start + n)
            inputs.block_tables.append(seq.block_table[: -(-(start + n) // self.block_size)])
        return inputs

    @torch.inference_mode()
    def forward(self, inputs: StepInputs) -> torch.Tensor | None:
        """The block copies, then the new tokens through the model: final-norm hidden states
        [T, H] (None where the step has no tokens)."""
        self.copy_blocks(inputs.block_copies)
        if not inputs.token_ids:
            return None
        hidden = self._forward_decodes(inputs) if _decodes_only(inputs) else None
        if hidden is not None:
            return hidden
        plan = self.plan(inputs.query_lens, inputs.seq_lens, inputs.block_tables)
        return self.model.forward_embedded(self.embed(inputs.token_ids), plan, self.kv_caches)

    def _forward_decodes(self, inputs: StepInputs, logits: bool = False) -> torch.Tensor | None:
        """A decodes-only step's hidden states (or logits) in one call where the kernel family
        has one (`KernelOps.forward_decodes`); None: it has not."""
        return self.model.ops.forward_decodes(
            self.model,
            self.attention,
            inputs.token_ids,
            inputs.seq_lens,
            inputs.block_tables,
            self.kv_caches,
            logits=logits,
        )

    def embed(self, token_ids: list[int]) -> torch.Tensor:
        """The step's tokens embedded [T, H]."""
        return self.model.embed_tokens(torch.tensor(token_ids, dtype=torch.long).to(self.device))

    def close(self) -> None:
        """Let go of what the runner holds besides memory: the thread reserving the KV cache's
        pages (a tensor-parallel runner: its workers too)."""
        if self.reserving is not None:
            self.reserving.close()

    @torch.inference_mode()
    def execute(self, batch) -> torch.Tensor:
        """Run the batch's new tokens (after its block copies); float32 logits
        [num sampled seqs, V], rows in the order of the seqs with sample=True."""
        inputs = self.step_inputs(batch)
        if _decodes_only(inputs) and all(batch.sample) and not self.model.sharded:
            # token ids to logits in one call where the family has one (a lone request's step
            # then has no Python between its kernels)
            self.copy_blocks(inputs.block_copies)
            logits = None
            if self.captured is not None:
                logits = self.captured.logits(
                    inputs.token_ids, inputs.seq_lens, inputs.block_tables
                )
            if logits is None:
                logits = self._forward_decodes(inputs, logits=True)
            if logits is not None:
                return logits.float()
            inputs = replace(inputs, block_copies=[])  # made just now
        hidden = self.forward(inputs)
        if hidden is None:
            return torch.empty(0, self.config.vocab_size, dtype=torch.float32, device=self.device)

        last, offset = [], 0
        for n, s in zip(inputs.query_lens, batch.sample):
            offset += n
            if s:
                last.append(offset - 1)
        if not last:
            return torch.empty(0, self.config.vocab_size, dtype=torch.float32, device=self.device)
        return self.model.compute_logits(
            hidden.index_select(0, torch.tensor(last, device=self.device))
        )


def _decodes_only(inputs: StepInputs) -> bool:
    """Whether the step has tokens and every sequence adds exactly one."""
    return bool(inputs.token_ids) and all(n == 1 for n in inputs.query_lens)
