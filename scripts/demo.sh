#!/usr/bin/env bash
# The main job on a fresh machine: install, start the local Kafka + Redis stack, run the pipeline
# with the default model (SmolLM2-135M-Instruct), stream sample prompts' tokens live (one of them a
# two-turn session), print TTFT / TPOT / cached tokens per request, then stop the pipeline.
# The stack stays up for more: `.venv/bin/sluice stack down` stops it.
# Extra arguments go to `sluice run` (e.g. scripts/demo.sh --device cuda).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/bootstrap.sh
.venv/bin/sluice stack up
echo

mkdir -p .sluice
log=.sluice/demo-pipeline.log
echo "starting the pipeline (sluice run; log: $log)"
.venv/bin/sluice run "$@" >"$log" 2>&1 &
pipeline=$!

stop_pipeline() {
  if kill -0 "$pipeline" 2>/dev/null; then
    echo "stopping the pipeline"
    kill -TERM "$pipeline" 2>/dev/null || true
    wait "$pipeline" 2>/dev/null || true
  fi
}
trap stop_pipeline EXIT
trap 'exit 130' INT TERM

for ((i = 0; i < 600; i++)); do
  grep -q " up: reading " "$log" 2>/dev/null && break
  if ! kill -0 "$pipeline" 2>/dev/null; then
    echo "the pipeline exited before it was up; the end of $log:" >&2
    tail -n 30 "$log" >&2
    exit 1
  fi
  sleep 0.5
done
if ! grep -q " up: reading " "$log"; then
  echo "the pipeline did not come up in 5 minutes; the end of $log:" >&2
  tail -n 30 "$log" >&2
  exit 1
fi
grep -m1 "engine ready" "$log" | sed 's/^.*engine ready/engine ready/' || true
echo

status=0
.venv/bin/sluice demo || status=$?

echo
stop_pipeline
trap - EXIT
echo
echo "The Kafka + Redis stack is still running. Try:"
echo "  .venv/bin/sluice run &                                  # the pipeline again"
echo "  .venv/bin/sluice produce --chat --follow 'Tell me a joke.'"
echo "  .venv/bin/sluice chat --session my-chat"
echo "Stop the stack with: .venv/bin/sluice stack down"
exit $status
