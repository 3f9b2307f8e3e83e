"""`sluice bench` against a real pipeline on the real broker: two offered rates under a
concurrency cap, every request counted, the JSON and the figure written, and the cap kept (the
runner never held more requests than it)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from sluice.testing.pipeline_harness import PipelineProcess, free_port, new_prefix, scrape, value

pytestmark = pytest.mark.integration


def test_bench_reports_two_rates_under_a_concurrency_cap(bootstrap_servers, tmp_path):
    prefix = new_prefix()
    port = free_port()
    process = PipelineProcess(
        bootstrap_servers, None, prefix, tmp_path, "--metrics-port", str(port)
    )
    out, figure = tmp_path / "bench.json", tmp_path / "bench.png"
    try:
        process.wait_ready()
        done = subprocess.run(
            [sys.executable, "-m", "sluice", "bench", "--bootstrap-servers", bootstrap_servers]
            + ["--topic-prefix", prefix, "--request-rate", "4,inf", "--max-concurrency", "2"]
            + ["--num-prompts", "6", "--dataset", "random", "--input-len", "12"]
            + ["--output-len", "5", "--slo", "ttft=60s,tpot=10s", "--json", str(out)]
            + ["--plot", str(figure), "--timeout", "240"],
            capture_output=True,
            text=True,
            timeout=400,
        )
        peak = value(scrape(port), "sluice_runner_peak_queue")
    finally:
        process.stop()
    assert done.returncode == 0, done.stderr + process.tail()
    rows = json.loads(out.read_text())["results"]
    assert [r["request_rate"] for r in rows] == [4.0, "inf"]
    for row in rows:
        assert row["completed"] == 6 and row["failed"] == 0
        # random prompts ask for exactly 5 tokens each (ignore_eos)
        assert row["output_throughput"] * row["duration_s"] == pytest.approx(30)
        assert row["goodput"] == pytest.approx(row["request_throughput"])  # a loose SLO
        assert 0 < row["ttft_s"]["p50"] <= row["e2e_s"]["p50"]
        assert row["tpot_s"]["p50"] > 0
    assert peak <= 2
    assert figure.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "TTFT p50" in done.stdout
