"""`sluice bench`'s parts without a broker: the datasets and arrivals it sends, and the figures
it computes from what it saw (checked against numpy and hand-made request timelines)."""

from __future__ import annotations

import json
import math
import statistics

import numpy as np
import pytest

from sluice.cli.bench_report import RequestTimes, parse_slo, percentile, report, table
from sluice.cli.workload import Workload, arrival_times, requests, sample_prompts
from sluice.schemas import decode_request


def test_percentiles_are_numpys():
    rng = np.random.default_rng(0)
    for size in (1, 2, 7, 100):
        values = rng.exponential(size=size).tolist()
        for p in (0, 50, 90, 99, 100):
            assert percentile(values, p) == pytest.approx(np.percentile(values, p))
    assert percentile([], 50) is None


def test_slo_strings():
    assert parse_slo("ttft=500ms,tpot=50ms,e2e=2s") == {"ttft": 0.5, "tpot": 0.05, "e2e": 2.0}
    for bad in ("ttfb=1s", "ttft=fast", "ttft"):
        with pytest.raises(ValueError):
            parse_slo(bad)


def timeline(sent, tokens, done, output_tokens, error=None) -> RequestTimes:
    return RequestTimes(sent, tokens, done, output_tokens, prompt_tokens=10, error=error)


def test_latencies_throughput_and_goodput_from_timelines():
    fast = timeline(0.0, [0.1, 0.2, 0.3], 0.3, 3)  # TTFT 0.1, TPOT 0.1
    slow = timeline(0.5, [1.5, 1.7], 1.7, 3)  # TTFT 1.0, two tokens in the last event: TPOT 0.1
    failed = timeline(0.6, [0.9], 1.0, 1, error="internal: boom")
    row = report([fast, slow, failed], 4.0, parse_slo("ttft=500ms"), 2)
    assert row["completed"] == 2 and row["failed"] == 1
    assert row["duration_s"] == pytest.approx(1.7)
    assert row["output_throughput"] == pytest.approx(6 / 1.7)
    assert row["total_token_throughput"] == pytest.approx(26 / 1.7)
    assert row["goodput"] == pytest.approx(1 / 1.7)  # only `fast` meets the SLO
    assert row["ttft_s"]["mean"] == pytest.approx(0.55)
    assert row["tpot_s"]["p50"] == pytest.approx(0.1)
    assert sorted(row["itl_s"].values())[0] == pytest.approx(0.1)
    assert row["e2e_s"]["p50"] == pytest.approx(0.75)
    assert report([fast], 1.0, {}, None)["goodput"] is None  # no SLO, no goodput
    text = table([row])
    assert "4.0" in text.splitlines()[2] and "TTFT p50" in text


def test_arrivals():
    assert arrival_times(4, math.inf, "poisson", 0) == [0.0] * 4
    assert arrival_times(4, 2.0, "constant", 0) == [0.0, 0.5, 1.0, 1.5]
    times = arrival_times(4000, 8.0, "poisson", 1)
    gaps = [b - a for a, b in zip(times, times[1:])]
    assert statistics.fmean(gaps) == pytest.approx(1 / 8, rel=0.05)
    assert statistics.stdev(gaps) == pytest.approx(1 / 8, rel=0.1)  # exponential: sd = mean
    assert times == arrival_times(4000, 8.0, "poisson", 1)


def test_datasets_are_valid_requests_and_the_same_for_a_seed(tmp_path):
    random_load = Workload(dataset="random", num_prompts=20, input_len=30, range_ratio=0.5)
    bodies = requests(random_load)
    assert bodies == requests(random_load)
    assert all(15 <= len(b["prompt"].split()) <= 45 for b in bodies)
    assert all(b["max_tokens"] == 64 and b["ignore_eos"] for b in bodies)
    shipped = sample_prompts()
    assert len(shipped) >= 40
    for body in requests(Workload(dataset="sample", num_prompts=45)) + bodies:
        decode_request(json.dumps(body))
    lines = tmp_path / "mine.jsonl"
    lines.write_text('{"prompt": "a", "max_tokens": 3}\n\n{"model": "m", "prompt": "b"}\n')
    mine = requests(Workload(dataset=str(lines), num_prompts=3, output_len=7))
    assert [b.get("max_tokens") for b in mine] == [3, 7, 3]
    lines.write_text("not json\n")
    with pytest.raises(ValueError, match="line 1"):
        requests(Workload(dataset=str(lines)))
