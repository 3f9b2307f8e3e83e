"""What the engine decides once, at start, and the log lines that say so: whether the kernel family
runs the configuration at all, the dtype and quantization `auto` stands for here, from how many rows
quantized projections are widened, and the line a ready engine logs. Each choice is logged with its
reason; `LLMEngine` calls these in order while it builds and keeps only the results.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .errors import ConfigError
from .stored_quantization import quantization_as_stored

if TYPE_CHECKING:
    from torch import nn

    from .config import EngineConfig, ModelConfig
    from .kernel_ops.base import KernelOps
    from .loader import LoadedModel
    from .memory import MemoryReport
    from .provenance import Provenance

log = logging.getLogger("sluice.engine.engine")  # (the engine's lines, under the engine's name)


def check_family(config: EngineConfig, ops: KernelOps) -> None:
    """Refuse a configuration the kernel family cannot run, naming the field."""
    if config.cuda_graphs and not ops.captures_decode_graphs:
        raise ConfigError(
            f"cuda_graphs captures the triton kernels' decode steps, not the {ops.name} family's",
            field="cuda_graphs",
        )
    quantization = config.quantization
    if quantization not in (None, "auto") and quantization not in ops.quantizations:
        raise ConfigError(
            f"the {ops.name} kernels do not run quantization {quantization!r}",
            field="quantization",
        )


def choose_quantization(loaded: LoadedModel, ops: KernelOps) -> str | None:
    """`quantization="auto"`: the file's layers quantized as it stores them, and logged."""
    choice = quantization_as_stored(loaded.stored_formats, ops)
    log.info("quantization auto: %s (%s)", choice.quantization or "none", choice.reason)
    return choice.quantization


def choose_dtype(config: EngineConfig, model_config: ModelConfig, ops: KernelOps) -> str:
    """`dtype="auto"`: the faster precision here for this process's share of the model,
    measured (`dtype_probe`), and logged."""
    from .dtype_probe import choose_dtype as probe

    choice = probe(model_config, config.device, ops, config.quantization)
    timed = ", ".join(f"{d} {ms:.1f} ms" for d, ms in choice.ms.items())
    log.info(
        "dtype auto: %s (%s%s)",
        choice.dtype,
        choice.reason,
        f": the model's matmuls at 1, 16 and 256 rows took {timed}" if timed else "",
    )
    return choice.dtype


def hint_stored_quantization(config: EngineConfig, loaded: LoadedModel, ops: KernelOps) -> None:
    """A file whose matrices are quantized runs dequantized unless asked otherwise: say which
    `--quantization` multiplies them as stored (what a llama.cpp user expects of a GGUF)."""
    formats = loaded.stored_formats
    if config.quantization or not formats:
        return
    suggested = quantization_as_stored(formats, ops).quantization
    if suggested is None:
        return
    log.info(
        "%s stores its layers' matrices as %s; they run dequantized to %s here. "
        "--quantization %s (or auto) multiplies them quantized, as stored (less memory, "
        "faster a token: docs/ENGINE.md)",
        loaded.source,
        "/".join(formats),
        config.dtype,
        suggested,
    )


def choose_widening(config: EngineConfig, ops: KernelOps, model: nn.Module) -> None:
    """From how many rows a step widens each quantized projection to bfloat16 for a oneDNN
    matmul (`widen_probe`: measured, or cached), handed to the family, and the log line that
    says so. Only for a family that `measures_widening`, with quantized weights."""
    if not (config.quantization and ops.measures_widening):
        return
    from .widen_probe import choose_widening as probe
    from .widen_probe import projection_shapes

    choice = probe(projection_shapes(model.layers), config.torch_dtype)
    ops.widen_rows = choice.rows
    timed = "; ".join(
        f"{shape}: " + ", ".join(f"{rows} rows {a:.2f}/{b:.2f} ms" for rows, (a, b) in ms.items())
        for shape, ms in choice.ms.items()
    )
    if choice.rows:
        where = ", ".join(f"{n}x{k} from {rows} rows" for (n, k), rows in choice.rows.items())
        log.info(
            "%s weights widened to bfloat16 for large steps (%s): %s%s",
            config.quantization,
            choice.reason,
            where,
            f" (as stored / widened: {timed})" if timed else "",
        )
    else:
        log.info(
            "%s weights multiplied as stored at every step size (%s%s)",
            config.quantization,
            choice.reason,
            f"; as stored / widened: {timed}" if timed else "",
        )


@dataclass(frozen=True)
class ReadyReport:
    """What a ready engine tells its operator: the model, how it runs, what it holds."""

    seconds: float  # from the engine's construction to ready
    model_id: str
    model_config: ModelConfig
    config: EngineConfig
    kernels: str
    route: str  # the forward's route (`forward.choose_forward`)
    num_blocks: int
    max_model_len: int
    memory: MemoryReport
    provenance: Provenance

    def lines(self) -> list[str]:
        c, m, p = self.config, self.memory, self.provenance
        on = {True: "on", False: "off"}
        lines = [
            f"engine ready in {self.seconds:.1f} s: model {self.model_id} "
            f"({self.model_config.architecture}, {self.model_config.num_hidden_layers} layers), "
            f"dtype {c.dtype} on {c.device}, kernels {self.kernels} ({self.route}); weights "
            f"{m.weight_bytes / 2**20:.0f} MiB ({c.quantization or 'unquantized'}; "
            f"{m.weight_bytes_unquantized / 2**20:.0f} MiB as plain {c.dtype} tensors); KV cache "
            f"{self.num_blocks} blocks x {c.block_size} tokens ({m.kv_cache_bytes / 2**20:.0f} MiB "
            f"{m.kv_dtype}, {m.kv_tokens} tokens, {m.kv_tokens_gain:.1f}x the tokens of a "
            f"{c.dtype} cache of the same size); max_model_len {self.max_model_len}; "
            f"max_num_batched_tokens {c.max_num_batched_tokens}, max_num_seqs {c.max_num_seqs}, "
            f"prefix caching {on[bool(c.enable_prefix_caching)]}, "
            f"CUDA graphs {on[bool(c.cuda_graphs)]}",
            f"provenance: weights sha256 {p.weights_sha256[:16]}, tokenizer sha256 "
            f"{(p.tokenizer_sha256 or 'none')[:16]}, kernels {p.kernels}, deterministic "
            f"{on[bool(p.deterministic)]}, {p.device_name} "
            f"({' '.join(p.cpu_features) or 'no listed features'}), torch {p.torch_version}",
        ]
        if c.deterministic:
            lines.append(
                "deterministic mode: fixed-order matmuls and attention; a request's tokens depend "
                "on it and its seed alone (docs/REPRODUCIBILITY.md), at a cost in speed"
            )
        return lines
