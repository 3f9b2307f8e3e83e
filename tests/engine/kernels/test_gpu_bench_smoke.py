"""bench/gpu.py's smoke mode: every section on the CPU with tiny shapes, kernels in Triton's
interpreter. The GPU run happens once, unattended; this keeps it from dying on a typo.

Runs `python -m bench.gpu` in a subprocess (it sets TRITON_INTERPRET itself and must start
clean), then reads its JSON. A second run points it at a deliberately broken kernel package to
show that its checks fail wrong kernels, and that a lost CUDA context (simulated) hands the rest to
a child process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
KERNELS = ROOT / "sluice" / "engine" / "kernels"
UNITS = ("norm", "activation", "rotary", "kv_cache", "paged_attention", "sampling", "int8_linear")


def run_bench(
    args: list[str], tmp_path: Path, extra_path: Path | None = None
) -> tuple[subprocess.CompletedProcess, dict]:
    out = tmp_path / "gpu.json"
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONUNBUFFERED="1")
    if extra_path is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(extra_path), env.get("PYTHONPATH")]))
    proc = subprocess.run(
        [sys.executable, "-m", "bench.gpu", "--smoke", "--json", str(out), "--seed", "1234", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert out.exists(), f"no JSON written; stderr:\n{proc.stderr[-4000:]}"
    return proc, json.loads(out.read_text())


def test_smoke_runs_every_section(tmp_path):
    proc, report = run_bench([], tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert (
        "kernel cases:" in proc.stdout and "engine decode" in proc.stdout
    )  # the table, printed last
    assert report["device"]["smoke"] is True
    assert report["bandwidth"]["copy_gbs"] > 0

    rows = report["kernels"]
    for unit in UNITS:
        mine = [r for r in rows if r["unit"] == unit]
        assert mine, f"no row for {unit}"
        if not (KERNELS / f"{unit}.py").exists():
            assert [r["status"] for r in mine] == ["missing"], mine
            continue
        bad = [(r["case"], r["status"], r.get("why")) for r in mine if r["status"] != "pass"]
        assert not bad, f"{unit}: {bad}"
        timed = [r for r in mine if "triton_us" in r]
        assert timed, f"{unit}: nothing timed"
        for r in timed:
            assert r["triton_us"] > 0 and r["torch_us"] > 0 and r["bytes"] > 0 and r["gbs"] > 0

    engine = report["engine"]
    variants = {r["variant"] for r in engine}
    assert {"triton", "torch", "int8", "kv-int8"} <= variants
    for r in engine:
        if r["status"] == "missing":  # a kernel module the variant needs is not there yet
            continue
        assert r["status"] == "ok", r
        assert r["steps_timed"] >= 1 and r["ms_per_step"] > 0 and r["bound_ms"] > 0
        assert r["weight_bytes"] > 0 and r["kv_read_bytes"] > 0


BROKEN = {
    # NaN in one element the kernel "forgot", as an unwritten output would show on the GPU
    "norm.py": """
        from sluice.engine.kernels.norm import add_rmsnorm_torch

        def add_rmsnorm_triton(x, residual, weight, eps):
            normed, res = add_rmsnorm_torch(x, residual, weight, eps)
            normed = normed.clone()
            normed[-1, -1] = float("nan")
            return normed, res
    """,
    # one row a few percent off
    "activation.py": """
        from sluice.engine.kernels.activation import silu_and_mul_torch

        def silu_and_mul_triton(x):
            out = silu_and_mul_torch(x)
            out[0] *= 1.05
            return out
    """,
}


def test_checks_catch_broken_kernels_and_a_lost_context(tmp_path):
    pkg = tmp_path / "pkgs" / "broken_kernels"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    for name, src in BROKEN.items():
        (pkg / name).write_text(textwrap.dedent(src))
    proc, report = run_bench(
        [
            "--sections",
            "norm,activation",
            "--kernel-package",
            "broken_kernels",
            "--simulate-context-loss",
            "norm#0",
        ],
        tmp_path,
        extra_path=tmp_path / "pkgs",
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = report["kernels"]
    by_unit = {u: [r for r in rows if r["unit"] == u] for u in ("norm", "activation")}
    norm = by_unit["norm"]
    assert norm[0]["status"] == "error" and "simulated" in norm[0]["why"]
    # the rest ran in a child process and still found what is wrong
    assert report.get("children") and report["children"][0]["units"][0] == "kernels:norm"
    assert len(norm) >= 2 and all(r["status"] == "FAIL" for r in norm[1:]), norm
    assert "non-finite" in norm[1]["why"]
    assert by_unit["activation"] and all(r["status"] == "FAIL" for r in by_unit["activation"])
