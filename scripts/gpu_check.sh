#!/usr/bin/env bash
# Every GPU check in one unattended run, for a CUDA machine that may be lent for minutes:
# bench/gpu.py (kernels against torch, their bandwidth, engine decode against the HBM bound,
# CUDA graphs against eager), then the tests that run on CUDA when it is there.
#
#     scripts/gpu_check.sh [OUTDIR]     # logs and JSON in OUTDIR (default bench/results)
#
# Needs python3 with PyTorch (CUDA), Triton, numpy, transformers and pytest: the engine's own
# packages. Nothing of Kafka's or Redis's is imported. At most seven minutes: each part has
# its own time limit, so a hang in one still leaves the other's results.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-bench/results}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
py=${PYTHON:-python3}

"$py" - <<'EOF' 2>&1 | tee "$out/gpu_env.txt"
import platform, torch, triton
print("python", platform.python_version(), "torch", torch.__version__, "triton", triton.__version__)
print("cuda", torch.version.cuda, "device", torch.cuda.get_device_name(0) if torch.cuda.is_available() else None)
raise SystemExit(0 if torch.cuda.is_available() else 2)
EOF
[ "${PIPESTATUS[0]}" = 0 ] || { echo "no CUDA device: nothing to check"; exit 2; }

# bench/gpu.py keeps to --budget-s and ends itself --grace-s after it, writing what it measured
timeout 240 "$py" -m bench.gpu --budget-s 180 --grace-s 30 --json "$out/gpu.json" 2>&1 \
    | tee "$out/gpu_bench.log"
bench=${PIPESTATUS[0]}

# the tests whose cases run on CUDA when it is there (the rest of the suite is the CPU's)
timeout 180 "$py" -m pytest -q -p no:cacheprovider -p no:asyncio -rfEs \
    tests/engine/kernels/test_norm.py tests/engine/kernels/test_activation.py \
    tests/engine/kernels/test_rotary.py tests/engine/kernels/test_kv_cache.py \
    tests/engine/kernels/test_paged_attention.py tests/engine/kernels/test_int8_linear.py \
    tests/engine/kernels/test_sampling_kernel.py tests/engine/kernels/test_fixed_order_matmul.py \
    tests/engine/test_captured_decode.py tests/engine/test_engine_kernels.py \
    tests/engine/test_deterministic_triton.py tests/engine/test_sampling.py \
    tests/engine/test_model_vs_hf.py 2>&1 | tee "$out/gpu_tests.log"
tests=${PIPESTATUS[0]}

echo "bench/gpu.py exit $bench, CUDA tests exit $tests"
[ "$bench" = 0 ] && [ "$tests" = 0 ]
