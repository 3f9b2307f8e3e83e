#!/usr/bin/env bash
# The harness on a real tool-calling model: install, start the local Kafka + Redis stack, pull
# Qwen2.5-Coder 1.5B (about 1 GB, once), start the pipeline on it, a worker of the sandboxed python
# tool and the harness service, then ask the harness an arithmetic word problem and print the run
# as it happens: the model's call, the program's output, the answer. Stops what it started; the
# stack stays up (`.venv/bin/sluice stack down` stops it).
# A question of your own: scripts/demo_harness.sh "How many primes are below 1000?"
set -euo pipefail
cd "$(dirname "$0")/.."
question=${1:-"A shop sells pencils at 37 cents each. Ana buys 123 pencils and pays with a 50 dollar note. How much change does she get, in cents?"}
scripts/bootstrap.sh
.venv/bin/sluice stack up
.venv/bin/sluice models pull qwen2.5-coder-1.5b
echo

mkdir -p .sluice
prefix=harness-demo
started=()
stop_all() {
  for pid in "${started[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
  for pid in "${started[@]}"; do wait "$pid" 2>/dev/null || true; done
}
trap stop_all EXIT
trap 'exit 130' INT TERM

start() { # NAME READY-LINE COMMAND...: start it in the background, wait for its ready line
  local name=$1 ready=$2 log=.sluice/demo-harness-$1.log
  shift 2
  echo "starting $name (log: $log)"
  "$@" >"$log" 2>&1 &
  started+=($!)
  for ((i = 0; i < 600; i++)); do
    grep -q "$ready" "$log" 2>/dev/null && return 0
    if ! kill -0 "${started[-1]}" 2>/dev/null; then
      echo "$name exited before it was up; the end of $log:" >&2
      tail -n 30 "$log" >&2
      exit 1
    fi
    sleep 0.5
  done
  echo "$name did not come up in 5 minutes; the end of $log:" >&2
  tail -n 30 "$log" >&2
  exit 1
}

kafka=(--topic-prefix "$prefix")
start pipeline " up: reading " .venv/bin/sluice run --model qwen2.5-coder-1.5b --no-sessions "${kafka[@]}"
start python-tool "serving python" .venv/bin/sluice tools serve sluice.tools.python_tool:python "${kafka[@]}"
start harness "harness serving" .venv/bin/sluice agent serve "${kafka[@]}"
echo
echo "Q: $question"
# The first turn must call (the grammar holds it to a well-formed python call); later turns
# choose, and the one that calls nothing is the answer.
.venv/bin/sluice agent run "$question" --python --tool-choice required --max-tokens 300 "${kafka[@]}"
