"""Turns a ScheduledBatch into the step's inputs, makes its block copies, and runs one forward over
the flat batch by the route chosen when the runner was built (`forward.choose_forward`: layer by
layer, the native stack, captured CUDA graphs); returns logits.

It owns the paged KV cache: per layer a `LayerKVCache`, K and V of [num_blocks, Hkv, block_size, D]
(`attention.kv_cache_shape`) in the model dtype, or quantized with per-block-and-head scales.
"""

from __future__ import annotations

import math
import os

import torch

from .attention import kv_cache_shape
from .config import EngineConfig, ModelConfig
from .errors import ConfigError
from .forward import Forward, StepInputs, choose_forward
from .model import CausalLM
from .page_reservation import reserve_in_background
from .paged_cache import LayerKVCache, bytes_per_block
from .step_plan import AttentionSpec

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
        if model.ops.fixes_plain_layers_only and not config.plain_layers:
            raise ConfigError(
                f"deterministic mode runs the plain Llama layer only; the {config.architecture} "
                "layer's extra norms, QK-norm or GELU have no fixed-order kernels yet",
                field="deterministic",
            )
        self.kv_caches = [
            LayerKVCache.allocate(shape, kv_dtype, self.device)
            for _ in range(config.num_hidden_layers)
        ]
        self.attention = AttentionSpec.of(config, model.dtype, self.kv_caches[0])
        self.reserving = reserve_in_background([t for c in self.kv_caches for t in c.tensors()])
        self.route: Forward = choose_forward(
            model, self.attention, self.kv_caches, self.embed, engine_config
        )

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy whole KV blocks src -> dst in every layer (copy-on-write of a shared last block)."""
        if not copies:
            return
        src = torch.tensor([s for s, _ in copies], device=self.device)
        dst = torch.tensor([d for _, d in copies], device=self.device)
        for cache in self.kv_caches:
            cache.copy_blocks(src, dst)

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
        return self.route.hidden(inputs)

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
        return self.logits(self.step_inputs(batch), batch.sample)

    @torch.inference_mode()
    def logits(self, inputs: StepInputs, sample: list[bool]) -> torch.Tensor:
        """The block copies, then the new tokens through the model: float32 logits [n, V] of the
        last token of each sequence with sample[i]."""
        self.copy_blocks(inputs.block_copies)
        if not inputs.token_ids:
            return torch.empty(0, self.config.vocab_size, dtype=torch.float32, device=self.device)
        return self.route.logits(inputs, sample)
