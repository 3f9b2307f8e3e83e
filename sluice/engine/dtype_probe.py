"""`--dtype auto`: the precision this machine runs this model fastest in, measured, not guessed.

Whether bfloat16 beats float32 on a CPU is not written in its flags: with AVX512-BF16 it was 1.7x
faster on an AMD EPYC and slower on an Intel Xeon without AMX (docs/PERFORMANCE.md). So at start
the engine times its own kernels at the model's matmul shapes (every projection of a layer and
the LM head, the weights in the form the kernel family reads them) in each candidate dtype, for
a decode-sized, a batch-sized and a prefill-sized number of rows, interleaving the candidates,
and takes the fastest. Float32 keeps a tie (within TIE): it is the more precise.

The result is cached per machine (CPU model and flags, torch version, kernel family, weight form
and shapes) under the sluice cache directory, so a restart does not measure again; the start log
says what was measured or read and what was chosen. On CUDA, bfloat16 where the GPU has it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from .config import ModelConfig
from .cpu_kernels import cache_root, cpu_signature
from .kernel_ops.base import KernelOps

log = logging.getLogger(__name__)

CANDIDATES = ("float32", "bfloat16")
ROWS = (1, 16, 256)  # a decode of one sequence, a decode batch, a prefill chunk
REPEATS = 3  # timed rounds, each candidate once a round in turn; the median counts
TIE = 0.03  # bfloat16 must be this much faster to be chosen over float32
MAX_PROBE_ELEMS = 1 << 24  # a larger weight is timed on a slice of its rows, scaled up
CACHE_VERSION = 1


@dataclass(frozen=True)
class DtypeChoice:
    dtype: str
    ms: dict[str, float]  # per candidate: the model's matmuls for each of ROWS, added up
    measured: bool  # False: read from the cache (or decided without a probe)
    reason: str


def matmul_shapes(config: ModelConfig) -> list[tuple[int, int, int]]:
    """(N, K, count) of every matrix a forward multiplies by: a layer's four projections, once a
    layer (a mixture of experts: its MLP's as many times as a token runs experts), and the LM
    head."""
    c, layers = config, config.num_hidden_layers
    mlp, runs = c.intermediate_size, layers
    if c.num_experts:
        mlp, runs = c.moe_intermediate_size, layers * c.num_experts_per_tok
    return [
        (c.q_size + 2 * c.kv_size, c.hidden_size, layers),
        (c.hidden_size, c.q_size, layers),
        (2 * mlp, c.hidden_size, runs),
        (c.hidden_size, mlp, runs),
        (c.vocab_size, c.hidden_size, 1),
    ]


def choose_dtype(
    config: ModelConfig,
    device: str,
    ops: KernelOps,
    quantization: str | None,
    cache_dir: Path | None = None,
) -> DtypeChoice:
    """The dtype for `--dtype auto` (see the module's docstring)."""
    if device != "cpu":
        if torch.cuda.is_available() and torch.cuda.is_bf16_supported():
            return DtypeChoice("bfloat16", {}, False, "the GPU computes bfloat16 natively")
        return DtypeChoice("float32", {}, False, "the GPU has no bfloat16")
    shapes = matmul_shapes(config)
    key = _cache_key(shapes, ops, quantization)
    path = (cache_dir or cache_root()) / "dtype_probe.json"
    cached = read_cache(path).get(key)
    if cached is not None:
        return DtypeChoice(cached["dtype"], cached["ms"], False, "measured before on this machine")
    ms = probe(shapes, ops, quantization)
    fastest = min(ms, key=ms.__getitem__)
    dtype = "float32" if ms["float32"] <= ms[fastest] * (1 + TIE) else fastest
    write_cache(path, key, {"dtype": dtype, "ms": ms})
    return DtypeChoice(dtype, ms, True, "measured now")


def probe(
    shapes: list[tuple[int, int, int]], ops: KernelOps, quantization: str | None
) -> dict[str, float]:
    """Milliseconds the model's matmuls take in each candidate dtype, for each of ROWS rows,
    added up (each weight in the form `ops` reads, timed with `ops.linear`)."""
    from .weight_transforms import transform_linear
    from .weights import Linear

    g = torch.Generator().manual_seed(0)
    cases = []  # (dtype, layer, x per row count, scale)
    for n, k, count in shapes:
        rows = max(16, min(n, MAX_PROBE_ELEMS // k))  # a slice of a very large weight
        weight = torch.randn(rows, k, generator=g) / k**0.5
        for dtype in CANDIDATES:
            torch_dtype = getattr(torch, dtype)
            layer = transform_linear(
                Linear(weight.to(torch_dtype)), quantization, ops.weight_layout, ops.int8_format
            )
            xs = {m: torch.randn(m, k, generator=g).to(torch_dtype) for m in ROWS}
            cases.append((dtype, layer, xs, count * n / rows))
    with torch.inference_mode():
        for _, layer, xs, _ in cases:  # warm-up: first calls pay for allocation and dispatch
            ops.linear(xs[ROWS[0]], layer)
        times: dict[str, list[float]] = {d: [] for d in CANDIDATES}
        for _ in range(REPEATS):
            for dtype in CANDIDATES:
                total = 0.0
                for d, layer, xs, scale in cases:
                    if d != dtype:
                        continue
                    for m in ROWS:
                        start = time.perf_counter()
                        ops.linear(xs[m], layer)
                        total += (time.perf_counter() - start) * scale
                times[dtype].append(total * 1e3)
    return {d: statistics.median(t) for d, t in times.items()}


def _cache_key(shapes, ops: KernelOps, quantization: str | None) -> str:
    parts = [
        CACHE_VERSION,
        cpu_signature(),
        torch.__version__,
        torch.get_num_threads(),
        ops.name,
        ops.weight_layout,
        quantization or "none",
        ops.int8_format if quantization else "",
        shapes,
    ]
    return hashlib.sha256(json.dumps(parts).encode()).hexdigest()[:24]


def read_cache(path: Path) -> dict:
    """A per-machine cache file of what a start computes once (this probe's, `widen_probe`'s
    measurements, `provenance`'s weight digests): key -> result."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def write_cache(path: Path, key: str, value: dict) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        entries = read_cache(path)
        entries[key] = value
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(entries, indent=1))
        tmp.replace(path)
    except OSError as e:  # a read-only home still runs; it measures again next start
        log.warning("could not cache what was measured in %s: %s", path, e)
