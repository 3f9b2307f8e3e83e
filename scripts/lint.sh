#!/usr/bin/env bash
# Lint, format check and type check: ruff over the whole tree, mypy over the whole sluice package
# (configured in pyproject.toml). `scripts/lint.sh --fix` applies ruff's fixes and formatting
# instead of only checking.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/bootstrap.sh
if [[ ${1:-} == --fix ]]; then
  .venv/bin/ruff check --fix .
  .venv/bin/ruff format .
else
  .venv/bin/ruff check .
  .venv/bin/ruff format --check .
fi
.venv/bin/mypy
