"""Each kernel of deterministic mode gives the same bits built for the plain x86-64 level (SSE2,
no FMA) as built for this CPU (`-march=native`): the matmul, RMSNorm, SiLU, rotary, attention
and the sampler's softmax arithmetic, in float32 and bfloat16, on inputs that use every vector
and tail path. (The blocked int8 and 4- to 6-bit kernels have their own cross-build test in
test_block_int8_linear.py; the whole model's bits are the golden file's, test_golden_numerics.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from sluice.engine import cpu_kernels

# (under CI a machine without the kernels fails here: these tests are what the promise rests on)
pytestmark = pytest.mark.skipif(
    cpu_kernels.library() is None and os.environ.get("CI", "").lower() not in ("1", "true", "yes"),
    reason="the native CPU kernels are unavailable here",
)

# Hashes of each kernel's output on fixed inputs (numpy's generator: torch's randn itself draws
# other numbers on another CPU).
PROBE = r"""
import hashlib, json
import numpy as np, torch
from sluice.engine.cpu_kernels import fixed_order_linear as fol, layer_ops, paged_prefill
from sluice.engine.cpu_kernels import row_softmax

rng = np.random.default_rng(0)
def r(*shape, dt=torch.float32, scale=1.0):
    return (torch.from_numpy(rng.standard_normal(shape).astype(np.float32)) * scale).to(dt)
def h(*ts):
    d = hashlib.sha256()
    for t in ts:
        d.update(t.contiguous().view(torch.uint8).numpy().tobytes())
    return d.hexdigest()[:16]
out = {}
for dt in (torch.float32, torch.bfloat16):
    n = str(dt).split(".")[1]
    x, w, b = r(7, 203, dt=dt), r(45, 203, dt=dt), r(45, dt=dt)
    out[f"linear-{n}"] = h(fol.fixed_order_linear(x, fol.pack_fixed_order(w), b))
    out[f"rmsnorm-{n}"] = h(*layer_ops.add_rmsnorm_native(x, r(7, 203, dt=dt), r(203, dt=dt), 1e-5))
    out[f"silu-{n}"] = h(layer_ops.silu_and_mul_native(r(5, 2 * 331, dt=dt, scale=4)))
    q, k = r(7, 9, 64, dt=dt), r(7, 3, 64, dt=dt)
    angles = r(7, 32, scale=3)
    layer_ops.rotary_native_(q, k, angles.cos(), angles.sin())
    out[f"rotary-{n}"] = h(q, k)
    kc, vc, qq = r(4, 3, 16, 64, dt=dt), r(4, 3, 16, 64, dt=dt), r(40, 9, 64, dt=dt, scale=3)
    for window in (None, 11):
        o = torch.empty_like(qq)
        paged_prefill.paged_prefill_cpu(
            qq, o, torch.tensor([0]), torch.tensor([40], dtype=torch.int32),
            torch.tensor([45], dtype=torch.int32), kc, vc,
            torch.tensor([[2, 0, 3]], dtype=torch.int32), 0.125, window,
        )
        out[f"attention-{n}-{window}"] = h(o)
logits = r(3, 1001, scale=6)
logits[1, 5:700] = float("-inf")
lse = row_softmax.logsumexp_rows(logits)
probs = row_softmax.exp_shifted_rows(logits, lse)
out["softmax"] = h(lse, probs, row_softmax.cumsum_rows(probs))
print(json.dumps(out))
"""


def _probe(env: dict[str, str]) -> dict[str, str]:
    done = subprocess.run(
        [sys.executable, "-c", PROBE],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, **env},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_plain_x86_64_build_gives_this_cpus_bits():
    here = _probe({})
    # (a build is cached by its sources, flags, compiler and CPU: scripts/test_isa_levels.sh
    # makes the same one)
    plain = _probe({"SLUICE_NATIVE_CFLAGS": "-march=x86-64", "ATEN_CPU_CAPABILITY": "default"})
    # (with the bfloat16 dot instruction, bfloat16 has bits of its own: cpu_kernels.uses_bf16_dot)
    kept = [k for k in here if not (cpu_kernels.uses_bf16_dot() and "bfloat16" in k)]
    assert {k: plain[k] for k in kept if plain[k] != here[k]} == {}
