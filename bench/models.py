"""The catalog's models as a user starts them (`sluice models list`), each in a process of its
own: time to "engine ready", peak resident memory on the way and resident memory once ready
(against the model file's size), and a lone request's decode time per token.

    .venv/bin/python -m bench.models                    # every pulled model, int4 (as `auto`)
    .venv/bin/python -m bench.models --models qwen2.5-coder-1.5b --quantizations int4,none

The KV cache is reserved by a background thread after "engine ready" (docs/ENGINE.md): the
resident figure once ready leaves most of it out, the "+KV" one is taken once it is reserved
(`--kv-cache-mb` sizes it). Decode, after that and an 8-token warm-up: 64 greedy tokens after a
short prompt, end-of-sequence ignored, the mean of the steps after the first.
Writes bench/results/models.json.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results" / "models.json"
DECODE_TOKENS = 64


def _resident_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def measure(name: str, quantization: str, kv_cache_mb: int) -> dict:
    """In this process: start the engine on `name`, and what it cost."""
    import torch

    from sluice.engine.config import EngineConfig
    from sluice.engine.engine import LLMEngine
    from sluice.engine.loader import catalog
    from sluice.engine.sampling_params import SamplingParams

    path = catalog.locate(name)
    config = EngineConfig(
        quantization=None if quantization == "none" else quantization,
        kv_cache_bytes=kv_cache_mb * 2**20,
    )
    started = time.monotonic()
    engine = LLMEngine(str(path), config)
    ready_s = time.monotonic() - started
    peak_rss_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    rss_ready_mib = _resident_mib()
    reserving = engine.runner.reserving
    if reserving is not None:  # its pages are in the figures below, and not in the decode's time
        reserving.wait(timeout=300)
    rss_reserved_mib = _resident_mib()
    params = SamplingParams(temperature=0, max_tokens=DECODE_TOKENS, ignore_eos=True)
    engine.generate("Warm up", SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    engine.add_request("decode", "The history of the river", params)
    step_s = []
    while engine.has_unfinished():
        t = time.perf_counter()
        engine.step()
        step_s.append(time.perf_counter() - t)
    decode = step_s[1:]  # (the first step is the prompt's)
    return {
        "model": name,
        "quantization": quantization,
        "file_mib": path.stat().st_size / 2**20,
        "weights_mib": engine.memory.weight_bytes / 2**20,
        "ready_s": ready_s,
        "peak_rss_mib": peak_rss_mib,
        "rss_ready_mib": rss_ready_mib,
        "rss_with_kv_mib": rss_reserved_mib,  # once the KV cache's pages are reserved
        "kv_cache_mib": engine.memory.kv_cache_bytes / 2**20,
        "decode_ms_per_token": 1000 * sum(decode) / max(1, len(decode)),
        "kernels": engine.kernels,
        "dtype": engine.config.dtype,
        "cpu": engine.provenance.device_name,
        "threads": torch.get_num_threads(),
        "route": engine.runner.route.name,
    }


def main() -> None:
    p = argparse.ArgumentParser(
        prog="python -m bench.models",
        description=__doc__,
        formatter_class=argparse.RawTextHelpFormatter,
    )
    p.add_argument("--models", default=None, help="comma-separated (default: every pulled one)")
    p.add_argument("--quantizations", default="int4")
    p.add_argument("--kv-cache-mb", type=int, default=1024)
    p.add_argument("--json", type=Path, default=RESULTS)
    p.add_argument("--child", nargs=2, metavar=("MODEL", "QUANTIZATION"), help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        print(json.dumps(measure(*a.child, a.kv_cache_mb)))
        return

    from sluice.engine.loader import catalog

    names = a.models.split(",") if a.models else [m for m in catalog.MODELS if _pulled(m)]
    rows = []
    for name in names:
        for quantization in a.quantizations.split(","):
            args = ["--child", name, quantization, "--kv-cache-mb", str(a.kv_cache_mb)]
            print(f"starting {name} ({quantization}) ...", file=sys.stderr, flush=True)
            out = subprocess.run(
                [sys.executable, "-m", "bench.models", *args],
                capture_output=True,
                text=True,
                check=True,
                cwd=ROOT,
            ).stdout
            rows.append(json.loads(out.strip().splitlines()[-1]))
    print(
        f"{'model':<22} {'weights':<6} {'file MiB':>9} {'ready s':>8} {'peak MiB':>9} "
        f"{'x file':>7} {'ready MiB':>10} {'+KV MiB':>8} {'ms/token':>9}"
    )
    for r in rows:
        print(
            f"{r['model']:<22} {r['quantization']:<6} {r['file_mib']:>9.0f} {r['ready_s']:>8.1f} "
            f"{r['peak_rss_mib']:>9.0f} {r['peak_rss_mib'] / r['file_mib']:>7.2f} "
            f"{r['rss_ready_mib']:>10.0f} {r['rss_with_kv_mib']:>8.0f} "
            f"{r['decode_ms_per_token']:>9.2f}"
        )
    a.json.parent.mkdir(parents=True, exist_ok=True)
    if rows:
        print(f"{rows[0]['cpu']}, {rows[0]['threads']} threads")
    a.json.write_text(json.dumps({"runs": rows, "kv_cache_mb": a.kv_cache_mb}, indent=2))
    print(f"wrote {a.json}")


def _pulled(name: str) -> bool:
    from sluice.engine.errors import EngineError
    from sluice.engine.loader import catalog

    try:
        catalog.locate(name)
    except EngineError:
        return False
    return catalog.MODELS[name].served


if __name__ == "__main__":
    main()
