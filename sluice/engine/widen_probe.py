"""Whether a large step multiplies quantized weights as stored or widened to bfloat16, measured.

The native family multiplies int8 and int4 blocks as stored (`block_int8_linear`): at the row
counts of decode it reads 2-4x fewer bytes than a float matmul and wins. At a prefill's row counts
the arithmetic decides instead, and a CPU with AMX multiplies bfloat16 tiles several times faster
than the int8 dot products of AVX512-VNNI (on an Intel Xeon with AMX, 2 threads, 2048 rows of
SmolLM2's gate/up projection: 8.6 ms as stored, 2.1 ms in bfloat16 through oneDNN). There a step
with enough rows widens each weight to bfloat16 for the call (`widen_blocks`, ~0.3 ms for that
matrix) and multiplies it with oneDNN; the weights stay quantized in memory.

Where that pays is not written in the CPU's flags, so at start the engine times, for each of the
model's projection shapes and each of ROWS, the kernel on the stored blocks against widening
plus oneDNN, interleaved, and widens a shape from the smallest row count at which widening won
there and at every larger count probed; never where it did not win at the largest. Only for
bfloat16 activations: in float32 the int8 kernel was 2-5x faster than oneDNN at every row count
measured (docs/ENGINE.md). The result is cached per machine beside the dtype probe's;
`SLUICE_WIDEN_ROWS` overrides it in bfloat16 ("never", or a row count for every shape).

Widening changes a step's rounding (bfloat16 weights and activations instead of int8-quantized
activations), so in default mode a request's logits may depend on the size of the step it ran in;
deterministic mode never widens.
"""

from __future__ import annotations

import hashlib
import json
import os
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from .cpu_kernels import cache_root, cpu_signature, require_library
from .cpu_kernels.block_int8_linear import (
    FMT_Q4,
    FMT_Q5,
    FMT_Q6,
    BlockInt8Weight,
    block_int8_linear,
    blocks_of,
    pack_q5_blocks,
    pack_q6_blocks,
    widen_blocks,
)
from .dtype_probe import MAX_PROBE_ELEMS, read_cache, write_cache
from .weights import BlockInt8Linear, Linear

ROWS = (64, 256, 1024)  # a large decode batch, a prefill chunk, a large prefill step
REPEATS = 3
CACHE_VERSION = 1
ENV = "SLUICE_WIDEN_ROWS"

Shape = tuple[int, int, int]  # (N, K, fmt) of a packed weight


@dataclass(frozen=True)
class WidenChoice:
    rows: dict[tuple[int, int], int]  # (N, K) -> widen from this many rows; absent: never
    ms: dict[str, dict[int, tuple[float, float]]]  # "NxK" -> rows -> (as stored, widened)
    reason: str


def widen_from(times: dict[int, tuple[float, float]]) -> int | None:
    """The smallest row count from which widening (second time) beat the kernel on the stored
    blocks (first) at every larger count probed too; None where it lost at the largest."""
    start = None
    for rows in sorted(times, reverse=True):
        stored, widened = times[rows]
        if widened >= stored:
            break
        start = rows
    return start


def choose_widening(
    shapes: list[Shape], dtype: torch.dtype, cache_dir: Path | None = None
) -> WidenChoice:
    """Per projection shape, the rows from which a step widens its weight (module docstring)."""
    if dtype != torch.bfloat16:
        return WidenChoice({}, {}, "float32 activations: the stored blocks are faster")
    forced = os.environ.get(ENV, "").strip().lower()
    if forced:
        if forced == "never":
            return WidenChoice({}, {}, f"{ENV}=never")
        if not forced.isdigit() or int(forced) < 1:
            raise ValueError(f'{ENV} must be "never" or a row count, not {forced!r}')
        return WidenChoice({(n, k): int(forced) for n, k, _ in shapes}, {}, f"{ENV}={forced}")
    key = _cache_key(shapes)
    path = (cache_dir or cache_root()) / "widen_probe.json"
    cached = read_cache(path).get(key)
    if cached is None:
        ms = probe(shapes)
        write_cache(path, key, ms)
        reason = "measured now"
    else:
        ms = {name: {int(r): tuple(t) for r, t in times.items()} for name, times in cached.items()}
        reason = "measured before on this machine"
    rows = {}
    for n, k, _ in shapes:
        start = widen_from(ms[f"{n}x{k}"])
        if start is not None:
            rows[(n, k)] = start
    return WidenChoice(rows, ms, reason)


def _as_stored(x: torch.Tensor, packed: BlockInt8Weight) -> torch.Tensor:
    return block_int8_linear(x, packed)


def _widened(x: torch.Tensor, packed: BlockInt8Weight) -> torch.Tensor:
    return F.linear(x, widen_blocks(packed, x.dtype))


WAYS = (_as_stored, _widened)


def _random_weight(n: int, k: int, fmt: int, g: torch.Generator) -> BlockInt8Weight:
    """A random [n, k] weight packed in `fmt` (what the timings need is its format and shape)."""
    nb = blocks_of(k)
    if fmt in (FMT_Q5, FMT_Q6):  # (nothing here quantizes so: random codes and scales of the form)
        codes = torch.randint(0, 64 if fmt == FMT_Q6 else 32, (n, nb * 32), generator=g)
        d = (torch.rand(n, nb, generator=g) * 1e-3).half()
        if fmt == FMT_Q5:
            return pack_q5_blocks(codes.to(torch.uint8), d, -16 * d, k)
        sc = torch.randint(-128, 128, (n, 2 * nb), generator=g, dtype=torch.int8)
        return pack_q6_blocks(codes.to(torch.uint8), d, sc, k)
    w = torch.randn(n, k, generator=g) / k**0.5
    return BlockInt8Linear.quantize(Linear(w), 4 if fmt == FMT_Q4 else 8).packed


def probe(shapes: list[Shape]) -> dict[str, dict[int, tuple[float, float]]]:
    """Milliseconds, per shape and row count, of the kernel on stored blocks and of widening the
    weight and multiplying in bfloat16 (medians of REPEATS, the two interleaved). A very large
    weight is timed on a slice of its rows: both ways scale with them."""
    g = torch.Generator().manual_seed(0)
    out = {}
    with torch.inference_mode():
        for n, k, fmt in shapes:
            rows = max(16, min(n, MAX_PROBE_ELEMS // k))
            packed = _random_weight(rows, k, fmt, g)
            by_rows = {}
            for m in ROWS:
                x = torch.randn(m, k, generator=g).to(torch.bfloat16)
                for way in WAYS:  # warm-up
                    way(x, packed)
                times: list[list[float]] = [[], []]
                for _ in range(REPEATS):
                    for i, way in enumerate(WAYS):
                        start = time.perf_counter()
                        way(x, packed)
                        times[i].append((time.perf_counter() - start) * 1e3 * n / rows)
                by_rows[m] = (statistics.median(times[0]), statistics.median(times[1]))
            out[f"{n}x{k}"] = by_rows
    return out


def projection_shapes(layers) -> list[Shape]:
    """(N, K, fmt) of a decoder layer's packed projections (the first layer: all are alike)."""
    shapes = []
    for name in ("qkv", "o_proj", "gate_up", "down"):
        packed = getattr(getattr(layers[0], name), "packed", None)
        if isinstance(packed, BlockInt8Weight):
            shape = (packed.n, packed.k, packed.fmt)
            if shape not in shapes:
                shapes.append(shape)
    return shapes


def _cache_key(shapes: list[Shape]) -> str:
    library = Path(require_library()._name).name  # named by the kernels' sources and flags
    parts = [
        CACHE_VERSION,
        cpu_signature(),
        library,
        torch.__version__,
        torch.get_num_threads(),
        shapes,
    ]
    return hashlib.sha256(json.dumps(parts).encode()).hexdigest()[:24]
