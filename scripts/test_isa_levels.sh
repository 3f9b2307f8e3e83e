#!/usr/bin/env bash
# Deterministic mode promises one arithmetic whatever instruction set the native kernels are built
# for (docs/REPRODUCIBILITY.md). The suite runs them built for this CPU (-march=native); this runs
# the golden outputs again with them built for the lower x86-64 levels, and torch's own kernels
# held to the same level: the plain x86-64 (SSE2, no FMA), and on a CPU with AVX-512 also AVX2+FMA
# (x86-64-v3) and, where the CPU has VNNI or the bfloat16 dot too, AVX-512 without them
# (x86-64-v4). Each build is cached, so a second run starts at once. Arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/bootstrap.sh
flags=" $(grep -m1 '^flags' /proc/cpuinfo | cut -d: -f2) "
levels=("x86-64:default")
if [[ $flags == *" avx512f "* ]]; then
  levels+=("x86-64-v3:avx2")
  if [[ $flags == *" avx512_vnni "* || $flags == *" avx512_bf16 "* ]]; then
    levels+=("x86-64-v4:avx512")
  fi
fi
for level in "${levels[@]}"; do
  march=${level%%:*} aten=${level##*:}
  echo "test_isa_levels: kernels built with -march=$march, torch at ATEN_CPU_CAPABILITY=$aten"
  SLUICE_NATIVE_CFLAGS="-march=$march" ATEN_CPU_CAPABILITY=$aten \
    .venv/bin/python -m pytest tests/engine/test_golden_numerics.py "$@"
done
