#!/usr/bin/env bash
# The main job on a fresh machine: install, start the local Kafka + Redis stack, run the pipeline
# with the default model and stream sample prompts' tokens live.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/bootstrap.sh
.venv/bin/sluice stack up
echo
echo "The stack is up. The pipeline (sluice run / produce / tail) is not built yet: see README."
