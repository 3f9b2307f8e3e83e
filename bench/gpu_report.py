"""The output of bench/gpu.py: the JSON results file and the table printed at the end of a run
(or from an earlier run's JSON)."""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path

from bench.gpu_common import log


def write_json(report: dict, path: Path) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(report, indent=1, default=str))
        tmp.replace(path)
    except OSError as e:
        log(f"could not write {path}: {e}")


# --- the table ------------------------------------------------------------------------------------


def fmt(v, spec: str, dash: str = "-") -> str:
    """format(v, spec), or a dash of the same width where there is no value."""
    if v is None or (isinstance(v, float) and math.isnan(v)):
        width = "".join(itertools.takewhile(str.isdigit, spec))
        return format(dash, f">{width}") if width else dash
    try:
        return format(v, spec)
    except (TypeError, ValueError):
        return str(v)


def print_table(r: dict) -> None:
    d, bw = r.get("device", {}), r.get("bandwidth", {})
    print()
    print(
        f"{d.get('name', '?')} (cc {d.get('capability', '-')}, {d.get('sms', '-')} SMs); "
        f"torch {d.get('torch')}, triton {d.get('triton')}, CUDA {d.get('cuda', '-')}"
        + ("; SMOKE (CPU, Triton interpreter)" if d.get("smoke") else "")
    )
    if bw:
        print(
            f"bandwidth: copy {fmt(bw.get('copy_gbs'), '.0f')} GB/s (read+write), "
            f"read {fmt(bw.get('read_gbs'), '.0f')}, write {fmt(bw.get('write_gbs'), '.0f')} GB/s"
            f"  [{bw.get('bytes', 0) / 2**20:.0f} MiB buffers]"
        )
    rows = r.get("kernels", [])
    if rows:
        print()
        print(
            f"{'kernel':17} {'case':44} {'dtype':5} {'max abs':>9} {'rel err':>8} {'pass':>7} "
            f"{'us':>9} {'torch us':>9} {'GB/s':>7} {'% copy':>6} {'x torch':>7}  note"
        )
        for k in rows:
            status = k.get("status", "?")
            note = " ".join(
                filter(
                    None,
                    [k.get("note"), k.get("why") if status != "pass" else None, k.get("timing")],
                )
            )
            print(
                f"{k.get('kernel', ''):17.17} {k.get('case', ''):44.44} {k.get('dtype', ''):5} "
                f"{fmt(k.get('max_abs'), '9.2e')} {fmt(k.get('max_rel'), '8.1e')} {status:>7} "
                f"{fmt(k.get('triton_us'), '9.1f')} {fmt(k.get('torch_us'), '9.1f')} "
                f"{fmt(k.get('gbs'), '7.0f')} "
                f"{fmt(100 * k['frac_copy'] if 'frac_copy' in k else None, '5.0f')}"
                f"{'%' if 'frac_copy' in k else ' '} {fmt(k.get('speedup'), '7.2f')}  "
                f"{note}"[:260]
            )
        n = {
            s: sum(1 for k in rows if k.get("status") == s)
            for s in ("pass", "FAIL", "error", "missing")
        }
        print(
            f"kernel cases: {n['pass']} pass, {n['FAIL']} FAIL, {n['error']} error, "
            f"{n['missing']} missing"
        )
        mb = [k for k in rows if "frac_copy" in k and k.get("memory_bound", True)]
        if mb:
            low = [
                f"{k['kernel']} [{k['case'][:28].strip()}] {100 * k['frac_copy']:.0f}%"
                for k in mb
                if k["frac_copy"] < 0.7
            ]
            print(
                f"memory-bound cases at >= 70% of the copy bandwidth: "
                f"{len(mb) - len(low)}/{len(mb)}" + (f"; below: {', '.join(low)}" if low else "")
            )
    eng = r.get("engine", [])
    if eng:
        print()
        print(
            "engine decode (Llama-3-8B-shaped, random bf16 weights"
            + (", tiny model in smoke mode" if d.get("smoke") else "")
            + "); bound = (weights read + KV read) / copy bandwidth"
        )
        print(
            f"{'variant':9} {'batch':>5} {'ms/step':>8} {'tok/s':>8} {'bound ms':>8} "
            f"{'x bound':>7} {'w-only ms':>9} {'x w-only':>8} {'prefill s':>9} "
            f"{'weights GiB':>11}  note"
        )
        for e in eng:
            if e.get("status") not in ("ok", None):
                print(
                    f"{e.get('variant', ''):9} {str(e.get('batch', '')):>5} "
                    f"{e.get('status')}: {e.get('why', '')}"[:400]
                )
                continue
            print(
                f"{e['variant']:9} {e['batch']:>5} {fmt(e.get('ms_per_step'), '8.2f')} "
                f"{fmt(e.get('tok_s'), '8.1f')} {fmt(e.get('bound_ms'), '8.2f')} "
                f"{fmt(e.get('x_bound'), '7.2f')} {fmt(e.get('bound_w_ms'), '9.2f')} "
                f"{fmt(e.get('x_bound_w'), '8.2f')} {fmt(e.get('prefill_s'), '9.2f')} "
                f"{fmt(e.get('weight_bytes', 0) / 2**30, '11.2f')}  {e.get('note', '')}"
                + (" (budget cut)" if e.get("budget_cut") else "")
            )
    print(
        f"targets: memory-bound kernels >= 70% of copy bandwidth; batch-1 decode <= 1.3x the "
        f"bound. elapsed {fmt(r.get('elapsed_s'), '.0f')} s"
    )
