#!/usr/bin/env bash
# Deterministic mode's Triton kernels must give the same bits whatever executes them. Under
# Triton's interpreter (how the tests run them on a CPU) a `tl.dot` is numpy's matmul, whose
# accumulation order belongs to the BLAS kernel OpenBLAS picks for the CPU, or to the one
# OPENBLAS_CORETYPE names (some machines pin Haswell's). So the tests of those guarantees run
# here once more with OpenBLAS forced to other kernels than the machine's own: Haswell's for the
# whole deterministic family, and Sandybridge's (another order, on any x86-64 CPU with AVX) for
# the matmul. A run whose kernels would be the machine's own anyway is left out: the suite runs
# those (the family's tests take about 5 minutes on a 2-core machine). Arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/bootstrap.sh
matmul=tests/engine/kernels/test_fixed_order_matmul.py
family=tests/engine/test_deterministic_triton.py
own=$(.venv/bin/python scripts/openblas_core.py)
if [[ $own == Haswell ]]; then
  echo "test_blas_kernels: this machine's OpenBLAS runs Haswell's kernels already; the suite checks them"
else
  echo "test_blas_kernels: OPENBLAS_CORETYPE=Haswell (this machine's own: ${own:-unknown})"
  OPENBLAS_CORETYPE=Haswell .venv/bin/python -m pytest "$matmul" "$family" "$@"
fi
echo "test_blas_kernels: OPENBLAS_CORETYPE=Sandybridge"
OPENBLAS_CORETYPE=Sandybridge .venv/bin/python -m pytest "$matmul" "$@"
