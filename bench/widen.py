"""Quantized weights widened to bfloat16 for large steps, against always as stored, in one run.

    .venv/bin/python -m bench.widen                 # int8 and int4, bfloat16 activations, 2 rounds
    .venv/bin/python -m bench.widen --quick --rounds 1

The engine benchmark's workload (64 requests of 32..512 prompt tokens, 128 tokens out, greedy, all
submitted at once; bench/engine_throughput.py's sluice phase, each run in its own process) with
the widening the engine chose at start (`widen_probe`: where this CPU multiplies bfloat16 faster
than the int8 kernel at a step's row count) against `SLUICE_WIDEN_ROWS=never`, the two interleaved
round by round. Reports output tokens/s (the whole workload, prefill included) and the single
request's ms/token (small steps: both ways should match), medians, and their ratios; writes
bench/results/widen.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from pathlib import Path

from bench import engine_throughput as et

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results" / "widen.json"

MODES = {"widened where faster": None, "always as stored": "never"}  # -> SLUICE_WIDEN_ROWS


def main() -> None:
    p = argparse.ArgumentParser(
        prog="python -m bench.widen",
        description=__doc__,
        formatter_class=argparse.RawTextHelpFormatter,
    )
    p.add_argument("--quantizations", default="int8,int4")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--quick", action="store_true", help="16 requests of 32..128 tokens, 32 out")
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--json", type=Path, default=RESULTS)
    a = p.parse_args()
    a.dtype, a.wait_idle, a.retries = "bfloat16", 0, 0
    quick = dict(
        num_requests=16,
        prompt_min=32,
        prompt_max=128,
        output_len=32,
        single_prompt_len=64,
        single_output_len=32,
    )
    w = dict(quick if a.quick else et.FULL_WORKLOAD, seed=0)
    w["prompt_tokens"] = et.prompt_tokens(w)
    extra = ["--kv-cache-mib", str(et.kv_cache_mib_for(w, 2)), "--tm-samples", "0"]
    runs: dict[str, dict[str, list[dict]]] = {}
    for quant in a.quantizations.split(","):
        runs[quant] = {m: [] for m in MODES}
        for r in range(a.rounds):
            for mode in MODES if r % 2 == 0 else list(MODES)[::-1]:
                env = MODES[mode]
                if env is None:
                    os.environ.pop("SLUICE_WIDEN_ROWS", None)
                else:
                    os.environ["SLUICE_WIDEN_ROWS"] = env
                et.log(f"{quant}, {mode}: round {r + 1}/{a.rounds}")
                result = et.spawn("sluice", a, w, [*extra, "--quantization", quant])
                result.pop("outputs", None)
                runs[quant][mode].append(result)
    os.environ.pop("SLUICE_WIDEN_ROWS", None)

    cpu = et.cpu_model()
    print(f"\n{cpu}, {a.threads} threads, bfloat16 activations; workload {w}")
    print("| weights | mode | tok/s | x as stored | batch 1 ms/token | x as stored |")
    print("|---|---|---|---|---|---|")
    summary = {}
    for quant, by_mode in runs.items():
        med = {
            m: (
                statistics.median(r["throughput_tok_s"] for r in rs),
                statistics.median(r["single_ms_per_token"] for r in rs),
            )
            for m, rs in by_mode.items()
        }
        base = med["always as stored"]
        for m, (tput, ms) in med.items():
            ratios = f"{tput / base[0]:.2f} | {ms:.2f} | {ms / base[1]:.2f}"
            print(f"| {quant} | {m} | {tput:.1f} | {ratios} |")
        summary[quant] = med
    a.json.parent.mkdir(parents=True, exist_ok=True)
    a.json.write_text(
        json.dumps(
            {"cpu": cpu, "threads": a.threads, "workload": w, "median": summary, "runs": runs},
            indent=1,
        )
    )
    print(f"wrote {a.json}")


if __name__ == "__main__":
    main()
