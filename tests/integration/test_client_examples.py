"""The client examples against the real broker and a real pipeline, as a user would run them:
examples/confluent_client.py (librdkafka's client) and examples/faust_client.py (a
faust-streaming app, in a virtual environment of its own: faust-streaming pins a click older than
the one our dev tools need)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from sluice.engine.cpu_kernels import cache_root
from sluice.testing.pipeline_harness import PipelineProcess, new_prefix

pytestmark = pytest.mark.integration

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
FAUST = "faust-streaming==0.15.3"


def faust_python() -> str:
    """The interpreter of a virtual environment with faust-streaming (made once, then reused)."""
    venv = cache_root() / "example-venvs" / FAUST.replace("==", "-")
    python = venv / "bin" / "python"
    if not (venv / ".complete").exists():
        subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True)
        subprocess.run([str(python), "-m", "pip", "install", "-q", FAUST], check=True, timeout=600)
        (venv / ".complete").touch()
    return str(python)


def test_the_confluent_kafka_and_faust_examples(bootstrap_servers, tmp_path):
    python = faust_python()  # before the pipeline starts: it may take a while the first time
    prefix = new_prefix()
    process = PipelineProcess(bootstrap_servers, None, prefix, tmp_path)
    try:
        process.wait_ready()
        confluent = subprocess.run(
            [sys.executable, str(EXAMPLES / "confluent_client.py"), "Name a colour."]
            + ["--bootstrap-servers", bootstrap_servers, "--topic-prefix", prefix]
            + ["--max-tokens", "8"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        faust = subprocess.run(
            [python, str(EXAMPLES / "faust_client.py"), "Name a colour.", "Name a fruit."],
            capture_output=True,
            text=True,
            timeout=180,
            env={
                **os.environ,
                "KAFKA_BOOTSTRAP_SERVERS": bootstrap_servers,
                "SLUICE_TOPIC_PREFIX": prefix,
            },
        )
    finally:
        process.stop()
    assert confluent.returncode == 0, confluent.stderr
    text, summary = confluent.stdout.rstrip("\n").rsplit("\n", 1)
    assert text.strip() and summary.startswith("[length: 8 tokens; prompt ")

    assert faust.returncode == 0, faust.stdout[-3000:] + faust.stderr[-3000:]
    output = faust.stdout + faust.stderr
    for prompt in ("'Name a colour.' -> '", "'Name a fruit.' -> '"):
        (line,) = [line for line in output.splitlines() if prompt in line]
        assert line.split(prompt, 1)[1].rstrip("' ")  # a reply that is not empty
