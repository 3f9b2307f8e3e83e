"""The CPU-only torch wheel has no Triton: every engine flag a CPU image offers must still work
there, and give the tokens it gives with Triton installed (Triton is for CUDA; on the CPU the
native and torch kernels run either way). Each run is a fresh process in which `import triton`
fails, as it does in such an environment."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow

FLAG_SETS = [
    ["--dtype", "float32", "--quantization", "int8", "--kv-cache-dtype", "int8"],
    ["--dtype", "float32", "--quantization", "int4", "--no-prefix-caching"],
    ["--dtype", "float32", "--kernels", "torch", "--kv-cache-dtype", "int8"],
    ["--dtype", "bfloat16", "--deterministic"],
]

# Runs `sluice generate` once per flag set in one process, printing each JSON line.
SCRIPT = """
import contextlib, io, json, sys
if sys.argv[1] == "blocked":
    sys.modules["triton"] = None  # what `import triton` does where it is not installed
    sys.modules["triton.language"] = None
from sluice.cli import main
for flags in json.loads(sys.argv[2]):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(["generate", "--json", "--temperature", "0", "--max-tokens", "6",
                     "--kv-cache-mb", "64", *flags, "The capital of France is"])
    assert code == 0, (flags, code)
    print(out.getvalue().strip())
print("triton imported:", "triton" in sys.modules and sys.modules["triton"] is not None)
"""


def generate(triton: str) -> tuple[list[dict], str]:
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, triton, json.dumps(FLAG_SETS)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    *lines, imported = done.stdout.strip().splitlines()
    return [json.loads(line) for line in lines], imported


def test_every_cpu_flag_runs_without_triton_and_gives_the_same_tokens():
    without, imported = generate("blocked")
    assert imported == "triton imported: False"
    with_triton, _ = generate("allowed")
    assert len(without) == len(FLAG_SETS)
    for flags, a, b in zip(FLAG_SETS, without, with_triton):
        assert a["token_ids"] and a["token_ids"] == b["token_ids"], flags
        assert a["text"] == b["text"], flags
