#!/usr/bin/env bash
# Deterministic mode's Triton kernels must give the same bits whatever executes them. Under
# Triton's interpreter (how the tests run them on a CPU) a `tl.dot` is numpy's matmul, whose
# accumulation order belongs to the BLAS kernel OpenBLAS picks for the CPU, or to the one
# OPENBLAS_CORETYPE names (some machines pin Haswell's). So the tests of those guarantees run
# here once more with OpenBLAS forced to other kernels than the machine's own: Haswell's for the
# whole deterministic family, and Sandybridge's (another order, on any x86-64 CPU with AVX) for
# the matmul. Arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/bootstrap.sh
matmul=tests/engine/kernels/test_fixed_order_matmul.py
family=tests/engine/test_deterministic_triton.py
echo "test_blas_kernels: OPENBLAS_CORETYPE=Haswell"
OPENBLAS_CORETYPE=Haswell .venv/bin/python -m pytest "$matmul" "$family" "$@"
echo "test_blas_kernels: OPENBLAS_CORETYPE=Sandybridge"
OPENBLAS_CORETYPE=Sandybridge .venv/bin/python -m pytest "$matmul" "$@"
