"""`sluice replay` on `sluice generate --json` records: a deterministic sampled run replays
identically; a record that does not match what the engine makes is reported at its first
differing token (exit 1); provenance fields that differ are named."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from sluice.cli.replay import expectation


def sluice(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "sluice", *args], capture_output=True, text=True, timeout=600
    )


@pytest.fixture(scope="module")
def record() -> dict:
    result = sluice(
        "generate", "--json", "--deterministic", "--chat", "--temperature", "1.0",
        "--max-tokens", "10", "--ignore-eos", "--kv-cache-mb", "64", "Name a colour.",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def replay(tmp_path, record: dict, *args: str) -> subprocess.CompletedProcess:
    path = tmp_path / "record.jsonl"
    path.write_text(json.dumps(record) + "\n")
    return sluice("replay", str(path), "--kv-cache-mb", "64", *args)


def test_a_deterministic_run_replays_identically(tmp_path, record):
    result = replay(tmp_path, record)
    assert result.returncode == 0, result.stderr
    assert "identical: 10 tokens of prompt-0" in result.stdout
    assert "provenance: the same as this engine's" in result.stdout
    assert "expected to reproduce on any CPU: deterministic mode, numerics 1" in result.stdout


def test_the_first_differing_token_is_reported(tmp_path, record):
    tampered = {**record, "token_ids": list(record["token_ids"])}
    tampered["token_ids"][5] = (tampered["token_ids"][5] + 1) % 1000
    result = replay(tmp_path, tampered)
    assert result.returncode == 1, result.stderr
    assert "differs at completion 0, token 5" in result.stdout
    assert "the 5 before it are identical" in result.stdout


def test_provenance_fields_that_differ_are_named(tmp_path, record):
    other = {**record, "provenance": {**record["provenance"], "torch_version": "0.0.1"}}
    result = replay(tmp_path, other, "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["identical"] is True and report["tokens"] == 10
    assert report["provenance_differences"] == {
        "torch_version": {"recorded": "0.0.1", "here": record["provenance"]["torch_version"]}
    }
    # another torch does not void deterministic mode's promise; another numerics version does
    assert report["expected_to_reproduce"] is True
    older = {**record, "provenance": {**record["provenance"], "numerics": None}}
    report = json.loads(replay(tmp_path, older, "--json").stdout)
    assert report["expected_to_reproduce"] is False
    assert report["why_not"] == ["recorded under numerics None, this is 1"]


def test_what_voids_the_promise_is_named():
    here = {
        "deterministic": True, "numerics": 1, "weights_sha256": "w", "dtype": "bfloat16",
        "quantization": None, "kv_cache_dtype": "bfloat16", "device": "cpu",
        "device_name": "Intel Xeon", "cpu_features": ["avx2", "fma"], "native_build": "gcc -O3",
    }  # fmt: skip
    moved = {**here, "device_name": "AMD EPYC", "native_build": "gcc -O3 -march=x86-64"}
    assert expectation(moved, here) == (True, [])
    assert expectation({**here, "deterministic": False}, here)[1] == [
        "not recorded in deterministic mode: its bits depend on the batch and machine"
    ]
    assert expectation({**here, "weights_sha256": "v"}, here)[1] == [
        "other weights (weights_sha256)"
    ]
    dot = {**here, "cpu_features": ["avx2", "fma", "avx512_bf16"]}
    assert expectation(dot, here)[1] == [
        "bfloat16 with the bfloat16 dot instruction on one side only (cpu_features)"
    ]
    assert expectation(
        {**dot, "dtype": "float32", "kv_cache_dtype": "float32"},
        {**here, "dtype": "float32", "kv_cache_dtype": "float32"},
    ) == (True, [])
    assert expectation({}, here) == (False, ["no provenance was recorded"])


def test_input_it_cannot_replay_is_refused_with_the_reason(tmp_path):
    events = tmp_path / "events.jsonl"
    events.write_text(json.dumps({"type": "token", "request_id": "r", "seq": 0}) + "\n")
    result = sluice("replay", str(events))
    assert result.returncode == 2 and "give --request FILE" in result.stderr
    result = sluice("replay")
    assert result.returncode == 2 and "--request-id" in result.stderr
