"""One-shot GPU check and timing of sluice's Triton kernels and of engine decode.

    python3 -m bench.gpu                       # on a CUDA machine: the whole run, < 5 minutes
                                               # on an H200
    python3 -m bench.gpu --sections kernels    # a subset: device, kernels, engine, or units such as
    python3 -m bench.gpu --sections norm,sampling,engine:torch
    python3 -m bench.gpu --smoke               # no GPU needed: every section on the CPU,
                                               # tiny shapes, kernels in Triton's interpreter
                                               # (< 1 minute)
    python3 -m bench.gpu --table-from bench/results/gpu.json   # print the table of an earlier run

It is meant to be run once, unattended: every kernel case and every engine variant is wrapped so a
failure is reported (in the table and the JSON) and the rest still runs. A CUDA error that kills
the context (an illegal address, say) is detected after the failing case, and the remaining work
continues in a fresh child process. `--budget-s` (default 240) is a soft limit: kernel timing stops
early enough to leave the engine section its share, past the budget kernel cases still check
correctness but skip timing and engine variants are skipped; a watchdog ends the run `--grace-s`
(default 40) after it with what was measured so far (the table and the JSON are written anyway).

Sections, in order:
  device   name, capability, torch / Triton / CUDA versions; device-to-device copy bandwidth (1 GiB
           tensor, CUDA events, median of 20 copies, bytes read + written) plus read-only (a sum)
           and write-only (a fill) rates for reference. The copy rate is the yardstick below.
  kernels  every kernel of sluice/engine/kernels/ against its torch reference on fresh random
           inputs at Llama-3-8B shapes (H=4096, I=14336, Hq=32, Hkv=8, D=128, vocab 128256;
           decode batches of 1 and 64, T=2048 tokens for the elementwise kernels), bfloat16, plus
           int8 and fp8 KV caches and int8 weights; max abs / rel error (max abs error / max
           |reference|) and pass/fail (element-wise |kernel - ref| <= tol * (|ref| + rms(ref)),
           tol 2e-2 in bfloat16; quantized caches within one quantization step; sampling by the
           allowed token sets, determinism and the empirical distribution), and where cheap the
           error of both against float64 (a wrong reference fails the case too). Then
           CUDA-event timing of the kernel and of its torch eager reference (warm-up, L2 flushed
           before each call, median), bytes moved per call (formula beside each case) -> GB/s and
           the fraction of the copy bandwidth, speedup over torch; TFLOP/s for int8_linear.
           Outputs are checked for full coverage: NaN-filled `out=` buffers where a kernel takes
           one, else the allocator's next block is filled with NaN bytes first (best effort).
  engine   LLMEngine on a Llama-3-8B-shaped model with random bf16 weights made on the GPU:
           variants triton / torch kernels, triton with decode steps replayed from CUDA graphs
           (`--cuda-graphs`), int8 weights, fp8 KV cache, deterministic mode; batch 1
           and 64, prompts of 128 tokens, 64 timed decode steps after a few warm-up steps; even rows
           greedy (their tokens are compared across variants), odd rows sampled (temperature 0.8,
           top-k 50, top-p 0.95, seeded), so the sampling kernel runs too. Time per step against the
           HBM bound = bytes read per step (the weights, minus the embedding table of which a step
           reads only its rows, plus the KV cache read) / the measured copy bandwidth (bytes read +
           written per second, used as the rate for this read-only stream; the read-only rate is in
           the JSON too). Weight-only bound reported beside it.

Targets: memory-bound kernels (norm, activation, rotary, write_kv, decode attention, sampling,
int8_linear at small M) move bytes at >= 70% of the copy bandwidth; batch-1 decode runs within
1.3x of the HBM bound.

Prints the table last (progress goes to stderr) and writes bench/results/gpu.json (--json; a smoke
run writes gpu_smoke.json instead), also after each unit, so a killed run leaves its numbers.
Exit status: 0 when the run completed (failed checks are in the table, not in the status), 3 when
the watchdog ended it, 130 when interrupted, 1 on an error outside every case (a bug here).
"""

from __future__ import annotations

import os
import sys

# Triton decides at decoration time whether a kernel is compiled or interpreted: the switch must be
# set before anything imports a kernel module (importing torch does not import Triton).
if "--smoke" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import argparse  # noqa: E402
import json  # noqa: E402
import signal  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from pathlib import Path  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results" / "gpu.json"
# a smoke run never overwrites the GPU's results
SMOKE_RESULTS = RESULTS.with_name("gpu_smoke.json")

# The sections live in sibling modules. None of them imports a kernel module at import time: that
# waits for the first case, after the TRITON_INTERPRET switch above.
from bench.gpu_common import Ctx, MissingKernel, cuda_healthy, log  # noqa: E402
from bench.gpu_device import bandwidth, device_facts  # noqa: E402
from bench.gpu_engine import (  # noqa: E402
    DEFAULT_ENGINE_VARIANTS,
    ENGINE_VARIANTS,
    SMOKE_ENGINE_VARIANTS,
    engine_variant,
)
from bench.gpu_kernels_elementwise import cases_activation, cases_norm, cases_rotary  # noqa: E402
from bench.gpu_kernels_int8_linear import cases_int8_linear  # noqa: E402
from bench.gpu_kernels_kv import cases_kv_cache, cases_paged_attention  # noqa: E402
from bench.gpu_kernels_sampling import cases_sampling  # noqa: E402
from bench.gpu_report import print_table, write_json  # noqa: E402

# kernel unit -> its cases, in the order they run
KERNEL_CASES = {
    "norm": cases_norm,
    "activation": cases_activation,
    "rotary": cases_rotary,
    "kv_cache": cases_kv_cache,
    "paged_attention": cases_paged_attention,
    "sampling": cases_sampling,
    "int8_linear": cases_int8_linear,
}
KERNEL_UNITS = tuple(KERNEL_CASES)


# --- the runner -----------------------------------------------------------------------------------


def resolve_units(spec: str, smoke: bool, engine_variants: list[str]) -> list[str]:
    units = []
    for part in filter(None, (p.strip() for p in spec.split(","))):
        if part in ("all",):
            units += resolve_units("device,kernels,engine", smoke, engine_variants)
        elif part == "device":
            units.append("device")
        elif part == "kernels":
            units += [f"kernels:{k}" for k in KERNEL_UNITS]
        elif part == "engine":
            units += [f"engine:{v}" for v in engine_variants]
        elif part.removeprefix("kernels:") in KERNEL_UNITS:
            units.append("kernels:" + part.removeprefix("kernels:"))
        elif part.startswith("engine:") and part.removeprefix("engine:") in ENGINE_VARIANTS:
            units.append(part)
        else:
            raise SystemExit(
                f"unknown section {part!r}: use device, kernels, engine, "
                f"{', '.join(KERNEL_UNITS)}, or engine:<{'|'.join(ENGINE_VARIANTS)}>"
            )
    seen = set()
    return [u for u in units if not (u in seen or seen.add(u))]


class Runner:
    def __init__(self, ctx: Ctx, args, report: dict):
        self.ctx, self.args, self.report = ctx, args, report
        self.tokens_seen: dict = {}
        self.lock = threading.Lock()

    def add_rows(self, key: str, rows: list[dict]) -> None:
        with self.lock:
            self.report.setdefault(key, []).extend(rows)

    def run_units(self, units: list[str], resume_case: int = 0) -> None:
        for ui, unit in enumerate(units):
            if unit == "device":
                continue  # done up front
            first_case = resume_case if ui == 0 else 0
            lost = self.run_unit(unit, first_case)
            self.write_partial()
            if lost is not None:
                rest = units[ui + 1 :]
                if lost[1] is not None:
                    rest = [unit] + rest
                if rest:
                    self.continue_in_child(rest, lost[1] or 0)
                return

    def run_unit(self, unit: str, first_case: int):
        """Run one unit; None, or (unit, next case index or None) when the CUDA context was lost."""
        ctx = self.ctx
        section, name = unit.split(":", 1)
        if section == "kernels":
            try:
                cases = KERNEL_CASES[name](ctx)
            except MissingKernel as e:
                log(f"kernels {name}: missing ({e})")
                self.add_rows(
                    "kernels",
                    [
                        {
                            "unit": name,
                            "kernel": name,
                            "case": "-",
                            "status": "missing",
                            "why": str(e),
                        }
                    ],
                )
                return None
            except Exception as e:  # noqa: BLE001
                log(f"kernels {name}: import failed: {type(e).__name__}: {e}")
                self.add_rows(
                    "kernels",
                    [
                        {
                            "unit": name,
                            "kernel": name,
                            "case": "-",
                            "status": "error",
                            "why": f"import: {type(e).__name__}: {e}",
                            "traceback": traceback.format_exc(limit=6),
                        }
                    ],
                )
                return None if cuda_healthy(ctx.device) else (unit, None)
            for ci, case in enumerate(cases):
                if ci < first_case:
                    continue
                row = {"unit": name, "kernel": case.kernel, "case": case.label, "dtype": case.dtype}
                t = time.perf_counter()
                try:
                    if self.args.simulate_context_loss == f"{name}#{ci}":
                        raise RuntimeError("simulated loss of the CUDA context")
                    res = case.run()
                    row.update(res)
                    row["status"] = "pass" if res.get("ok") else "FAIL"
                except Exception as e:  # noqa: BLE001
                    row.update(
                        status="error",
                        why=f"{type(e).__name__}: {e}",
                        traceback=traceback.format_exc(limit=8),
                    )
                row["wall_s"] = time.perf_counter() - t
                row.pop("ok", None)
                self.add_rows("kernels", [row])
                log(
                    f"  {case.kernel} {case.label}: {row['status']}"
                    + (f" ({row['why']})" if row.get("why") else "")
                    + (
                        f", {row['triton_us']:.1f} us, {row['gbs']:.0f} GB/s"
                        if "triton_us" in row
                        else ""
                    )
                )
                if row["status"] == "error" and (
                    not cuda_healthy(ctx.device)
                    or self.args.simulate_context_loss == f"{name}#{ci}"
                ):
                    log("  the CUDA context is lost; the rest continues in a fresh process")
                    return unit, ci + 1 if ci + 1 < len(cases) else None
            return None
        # engine
        if ctx.time_left() < (5 if ctx.smoke else 30):
            self.add_rows(
                "engine", [{"variant": name, "batch": "-", "status": "skipped", "why": "budget"}]
            )
            return None
        a = self.args
        batches = (2,) if ctx.smoke else tuple(a.batches)
        prompt_len = 8 if ctx.smoke else a.prompt_len
        steps, warm = (1, 1) if ctx.smoke else (a.decode_steps, 4)
        try:
            rows = engine_variant(ctx, name, batches, prompt_len, steps, warm, self.tokens_seen)
            self.add_rows("engine", rows)
        except MissingKernel as e:
            self.add_rows(
                "engine", [{"variant": name, "batch": "-", "status": "missing", "why": str(e)}]
            )
        except Exception as e:  # noqa: BLE001
            if isinstance(e, ModuleNotFoundError) and (e.name or "").startswith(ctx.kernel_package):
                log(f"  engine {name}: missing kernel module {e.name}")
                self.add_rows(
                    "engine",
                    [
                        {
                            "variant": name,
                            "batch": "-",
                            "status": "missing",
                            "why": f"kernel module {e.name} does not exist",
                        }
                    ],
                )
                return None
            log(f"  engine {name}: {type(e).__name__}: {e}")
            self.add_rows(
                "engine",
                [
                    {
                        "variant": name,
                        "batch": "-",
                        "status": "error",
                        "why": f"{type(e).__name__}: {e}",
                        "traceback": traceback.format_exc(limit=10),
                    }
                ],
            )
            if not cuda_healthy(ctx.device):
                return unit, None
        return None

    def continue_in_child(self, units: list[str], resume_case: int) -> None:
        a, ctx = self.args, self.ctx
        left = ctx.time_left()
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "child.json"
            cmd = [
                sys.executable,
                "-m",
                "bench.gpu",
                "--sections",
                ",".join(units),
                "--resume-case",
                str(resume_case),
                "--json",
                str(out),
                "--child",
                "--budget-s",
                str(max(left, 1.0)),
                "--grace-s",
                str(max(5.0, a.grace_s - 15)),
                "--seed",
                str(ctx.seed + 7),
                "--copy-gbs",
                str(ctx.copy_gbs or 0),
                "--read-gbs",
                str(ctx.read_gbs or 0),
                "--prompt-len",
                str(a.prompt_len),
                "--decode-steps",
                str(a.decode_steps),
                "--batches",
                ",".join(map(str, a.batches)),
                "--kernel-package",
                a.kernel_package,
                "--engine-variants",
                ",".join(a.engine_variants),
            ]
            if ctx.smoke:
                cmd.append("--smoke")
            log(f"child process for: {', '.join(units)} (from case {resume_case})")
            self.report.setdefault("children", []).append(
                {"units": units, "resume_case": resume_case}
            )
            try:
                # (from the repository root, where `bench` is importable)
                subprocess.run(cmd, timeout=max(left, 1.0) + a.grace_s, check=False, cwd=ROOT)
            except subprocess.TimeoutExpired:
                log("child process timed out")
            if out.exists():
                child = json.loads(out.read_text())
                for key in ("kernels", "engine"):
                    self.add_rows(key, child.get(key, []))
                self.report.setdefault("children", []).extend(child.get("children", []))
            else:
                self.add_rows(
                    "kernels",
                    [
                        {
                            "unit": units[0],
                            "kernel": units[0],
                            "case": "-",
                            "status": "error",
                            "why": "the child process wrote no results",
                        }
                    ],
                )

    def write_partial(self) -> None:
        with self.lock:
            self.report["elapsed_s"] = self.ctx.elapsed()
            write_json(self.report, self.args.json)


# --- main -----------------------------------------------------------------------------------------


def main() -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.gpu",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--smoke",
        action="store_true",
        help="CPU, tiny shapes, Triton interpreter (implied without CUDA)",
    )
    p.add_argument(
        "--sections",
        default="device,kernels,engine",
        help="comma list: device, kernels, engine, a kernel unit ("
        + ", ".join(KERNEL_UNITS)
        + ") or engine:<variant>; the device facts and bandwidth are always measured",
    )
    p.add_argument(
        "--engine-variants",
        type=lambda s: [v for v in s.split(",") if v],
        default=None,
        help=f"engine variants for 'engine', in order "
        f"(default {','.join(DEFAULT_ENGINE_VARIANTS)}; "
        f"known: {','.join(ENGINE_VARIANTS)})",
    )
    p.add_argument(
        "--budget-s", type=float, default=240.0, help="soft time budget: timing stops past it"
    )
    p.add_argument(
        "--grace-s",
        type=float,
        default=40.0,
        help="the watchdog ends the run this long after the budget",
    )
    p.add_argument(
        "--batches",
        type=lambda s: [int(x) for x in s.split(",")],
        default=[1, 64],
        help="engine decode batch sizes (default 1,64)",
    )
    p.add_argument("--prompt-len", type=int, default=128, help="engine prompt tokens per request")
    p.add_argument(
        "--decode-steps", type=int, default=64, help="timed engine decode steps per batch size"
    )
    p.add_argument(
        "--seed", type=int, default=None, help="default: a fresh one (recorded in the JSON)"
    )
    p.add_argument(
        "--json",
        type=Path,
        default=None,
        help=f"results file (default {RESULTS.relative_to(ROOT)}, "
        f"or {SMOKE_RESULTS.name} beside it in smoke mode)",
    )
    p.add_argument(
        "--table-from", type=Path, metavar="JSON", help="print the table of an earlier run and exit"
    )
    p.add_argument("--copy-gbs", type=float, default=0.0, help=argparse.SUPPRESS)  # child processes
    p.add_argument("--read-gbs", type=float, default=0.0, help=argparse.SUPPRESS)
    p.add_argument("--resume-case", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--kernel-package", default="sluice.engine.kernels", help=argparse.SUPPRESS)
    # test hook: behave as if case CASE of kernel unit UNIT ("UNIT#CASE") killed the CUDA context
    p.add_argument("--simulate-context-loss", default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.table_from:
        print_table(json.loads(a.table_from.read_text()))
        return 0

    smoke = a.smoke or not torch.cuda.is_available()
    a.json = a.json or (SMOKE_RESULTS if smoke else RESULTS)
    if smoke and not a.smoke:
        log("no CUDA device: running the smoke mode (CPU, tiny shapes, Triton interpreter)")
    a.engine_variants = a.engine_variants or list(
        SMOKE_ENGINE_VARIANTS if smoke else DEFAULT_ENGINE_VARIANTS
    )
    unknown = [v for v in a.engine_variants if v not in ENGINE_VARIANTS]
    if unknown:
        raise SystemExit(f"unknown engine variant(s) {unknown}; known: {list(ENGINE_VARIANTS)}")
    units = resolve_units(a.sections, smoke, a.engine_variants)
    seed = a.seed if a.seed is not None else int.from_bytes(os.urandom(3), "little")
    n_engine = sum(u.startswith("engine:") for u in units)
    ctx = Ctx(
        smoke=smoke,
        device=torch.device("cpu" if smoke else "cuda"),
        dtype=torch.bfloat16,
        seed=seed,
        started=time.perf_counter(),
        budget_s=a.budget_s,
        engine_reserve_s=min(0.5 * a.budget_s, (8 if smoke else 25) * n_engine),
        kernel_package=a.kernel_package,
    )
    if smoke:
        torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    report: dict = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "command": " ".join(["python -m bench.gpu", *sys.argv[1:]]),
        "seed": seed,
        "units": units,
        "budget_s": a.budget_s,
    }
    runner = Runner(ctx, a, report)

    def finish(code: int) -> None:
        report["elapsed_s"] = ctx.elapsed()
        write_json(report, a.json)
        if not a.child:
            try:
                print_table(report)
            except Exception as e:  # noqa: BLE001  (the numbers are in the JSON anyway)
                log(f"could not print the table: {type(e).__name__}: {e}")
                print(
                    json.dumps(
                        {k: report.get(k) for k in ("kernels", "engine")}, indent=1, default=str
                    )
                )
            log(f"wrote {a.json}")
        sys.stdout.flush()
        sys.stderr.flush()

    def watchdog():
        deadline = a.budget_s + a.grace_s
        while ctx.elapsed() < deadline:
            time.sleep(1.0)
        log(f"watchdog: {deadline:.0f} s passed; ending with what was measured")
        with runner.lock:
            report["watchdog"] = f"ended after {ctx.elapsed():.0f} s"
            finish(3)
        os._exit(3)

    threading.Thread(target=watchdog, daemon=True).start()

    def on_term(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, on_term)
    code = 0
    try:
        try:
            report["device"] = device_facts(ctx)
        except Exception as e:  # noqa: BLE001
            report["device"] = {"name": "?", "error": f"{type(e).__name__}: {e}", "smoke": smoke}
        log(
            f"device: {report['device'].get('name')} torch {torch.__version__} "
            f"triton {report['device'].get('triton')} seed {seed}"
        )
        if a.copy_gbs:
            ctx.copy_gbs, ctx.read_gbs = a.copy_gbs, a.read_gbs or None
            report["bandwidth"] = {
                "copy_gbs": a.copy_gbs,
                "read_gbs": a.read_gbs,
                "from_parent": True,
            }
        else:
            try:
                bw = bandwidth(ctx)
                report["bandwidth"] = bw
                ctx.copy_gbs, ctx.read_gbs = bw["copy_gbs"], bw["read_gbs"]
                log(
                    f"bandwidth: copy {bw['copy_gbs']:.0f} GB/s, read {bw['read_gbs']:.0f}, "
                    f"write {bw['write_gbs']:.0f}"
                )
            except Exception as e:  # noqa: BLE001
                report["bandwidth"] = {"error": f"{type(e).__name__}: {e}"}
                log(f"bandwidth failed: {e}")
        runner.run_units(units, a.resume_case)
    except KeyboardInterrupt as e:
        report["interrupted"] = str(e) or "KeyboardInterrupt"
        code = 130
    except Exception as e:  # noqa: BLE001  (the run must end with a table)
        report["error"] = f"{type(e).__name__}: {e}"
        report["traceback"] = traceback.format_exc()
        log(report["traceback"])
        code = 1
    with runner.lock:
        finish(code)
    return code


if __name__ == "__main__":
    sys.exit(main())
