#!/usr/bin/env bash
# The whole test suite on a fresh machine: installs what it needs, then runs pytest. Integration
# tests start the local Kafka + Redis stack themselves (or use KAFKA_BOOTSTRAP_SERVERS / REDIS_URL).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/bootstrap.sh
exec .venv/bin/python -m pytest "$@"
