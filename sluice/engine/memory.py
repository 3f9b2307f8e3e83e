"""What the weights and the KV cache take, and what quantization saved.

Reported by the engine at start (its log line and `LLMEngine.memory`), so a user choosing
`--quantization int8` or `--kv-cache-dtype int8` sees the bytes and how many more tokens fit.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch

from .config import EngineConfig, ModelConfig
from .loader.tensor_names import expected_shapes
from .paged_cache import bytes_per_block


@dataclass(frozen=True)
class MemoryReport:
    weight_bytes: int  # as held, scales included
    weight_bytes_unquantized: int  # the same model in the engine's dtype
    kv_cache_bytes: int  # all layers, K and V, scales included
    kv_dtype: str
    kv_tokens: int  # tokens the cache holds
    kv_tokens_unquantized: int  # tokens the same bytes would hold in the engine's dtype

    @property
    def weight_shrink(self) -> float:
        return self.weight_bytes_unquantized / self.weight_bytes

    @property
    def kv_tokens_gain(self) -> float:
        return self.kv_tokens / max(1, self.kv_tokens_unquantized)

    def as_dict(self) -> dict:
        return {
            **asdict(self),
            "weight_shrink": self.weight_shrink,
            "kv_tokens_gain": self.kv_tokens_gain,
        }


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of all weights as held (a tensor shared by two modules counted once)."""
    seen, total = set(), 0
    for t in list(model.parameters()) + list(model.buffers()):
        if t.is_mkldnn:  # oneDNN's packed layout has no storage to share
            total += t.numel() * t.element_size()
            continue
        key = (t.untyped_storage().data_ptr(), t.dtype)
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
    return total


def memory_report(
    model_config: ModelConfig, engine_config: EngineConfig, model, runner
) -> MemoryReport:
    c, e = model_config, engine_config
    element = torch.empty(0, dtype=e.torch_dtype).element_size()
    unquantized = element * sum(math.prod(shape) for shape in expected_shapes(c).values())
    kv_bytes = sum(cache.nbytes for cache in runner.kv_caches)
    plain_block = bytes_per_block(c, e.block_size, e.torch_dtype)
    return MemoryReport(
        weight_bytes=weight_bytes(model),
        weight_bytes_unquantized=unquantized,
        kv_cache_bytes=kv_bytes,
        kv_dtype=str(e.kv_torch_dtype).removeprefix("torch."),
        kv_tokens=runner.num_blocks * e.block_size,
        kv_tokens_unquantized=kv_bytes // plain_block * e.block_size,
    )
