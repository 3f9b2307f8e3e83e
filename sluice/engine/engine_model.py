"""The model an engine runs, made from a loaded file: the dtype and quantization `auto` stands for
(`startup`), this process's share under tensor parallelism (the other ranks started on theirs),
the model built and its projections' widening chosen, the weights' digest taken, and the loaded
tensors let go (the model holds its own fused, cast copies)."""

from __future__ import annotations

import ctypes
import ctypes.util
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from . import startup
from .config import EngineConfig, ModelConfig
from .loader import LoadedModel, build_model
from .model_runner import num_kv_blocks
from .provenance import weights_sha256

if TYPE_CHECKING:
    from .kernel_ops.base import KernelOps
    from .model import CausalLM
    from .tensor_parallel.launcher import Workers


@dataclass
class EngineModel:
    config: EngineConfig  # as given, with `auto` dtype and quantization decided
    model: CausalLM  # all of it, or rank 0's share of its heads and columns
    rank_config: ModelConfig  # the shape of `model`
    num_blocks: int  # of the KV cache
    weights_hash: str  # of the weights as loaded (provenance)
    group: Any = None  # the tensor-parallel ranks' process group, when there are ranks


def prepare_model(
    loaded: LoadedModel, config: EngineConfig, ops: KernelOps, workers: Workers | None
) -> EngineModel:
    shards = None if workers is None else workers.shard_plan(loaded.config)
    rank_config = loaded.config if shards is None else shards.rank_config(0)
    if config.quantization == "auto":
        config = replace(config, quantization=startup.choose_quantization(loaded, ops))
    if config.dtype == "auto":
        config = replace(config, dtype=startup.choose_dtype(config, rank_config, ops))
    num_blocks = num_kv_blocks(loaded.config, config)
    group = None
    if workers is not None:
        group = workers.start(loaded.tensors, config, ops.name, num_blocks, loaded.source)
    # (before the model takes the tensors: weights built in memory are hashed as tensors)
    weights_hash = weights_sha256(loaded.source, loaded.tensors)
    model = build_model(
        rank_config,
        loaded.tensors if shards is None else shards.rank_tensors(loaded.tensors, 0),
        config.torch_dtype,
        config.device,
        quantization=config.quantization,
        ops=ops,
        source=loaded.source,
        # (a rank's share is cut from the values, as the other ranks': the file's blocks are
        # whole matrices)
        int4_blocks=loaded.int4_blocks if shards is None else None,
        int8_blocks=loaded.int8_blocks if shards is None else None,
        stored_rows=loaded.stored_rows if shards is None else None,
        stored_types=loaded.stored_types if shards is None else None,
        take_tensors=shards is None,
    )
    if workers is None:
        startup.choose_widening(config, ops, model)
    startup.hint_stored_quantization(config, loaded, ops)
    loaded.tensors = {}
    loaded.int4_blocks, loaded.int8_blocks = {}, {}
    _give_back_freed_memory()
    return EngineModel(config, model, rank_config, num_blocks, weights_hash, group)


def _give_back_freed_memory() -> None:
    """Hand the heap's free pages back to the system (glibc keeps what the load's float copies
    and temporaries freed: a 1.5B model's process stayed 2.5 GB larger than it needs)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):  # not glibc: nothing to do
        return
    trim(0)
