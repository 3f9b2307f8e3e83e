#!/usr/bin/env bash
# Lint, format check and type check: ruff over the whole tree, clang-format over the C kernels
# (sluice/engine/cpu_kernels, the style in .clang-format), mypy over the whole sluice package
# (configured in pyproject.toml). `scripts/lint.sh --fix` applies ruff's fixes and both formatters
# instead of only checking.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/bootstrap.sh
c_sources=(sluice/engine/cpu_kernels/*.c sluice/engine/cpu_kernels/*.h)
if ! command -v clang-format >/dev/null; then
  echo "lint: clang-format not found (apt-get install clang-format): it checks the C kernels" >&2
  exit 1
fi
if [[ ${1:-} == --fix ]]; then
  .venv/bin/ruff check --fix .
  .venv/bin/ruff format .
  clang-format -i "${c_sources[@]}"
else
  .venv/bin/ruff check .
  .venv/bin/ruff format --check .
  clang-format --dry-run --Werror "${c_sources[@]}"
fi
# (its cache outside the checkout: a fresh clone, as CI's, checks only what changed since the
# last run on this machine; mypy tells a cached module from a changed one by its content)
.venv/bin/mypy --cache-dir "${XDG_CACHE_HOME:-$HOME/.cache}/sluice/mypy"
