"""The harness over the real broker, with the real pipeline and model and a real tool worker: a run
asked for with `sluice agent run` calls its tool, reads the result and answers; the harness
service SIGKILLed while the tool runs picks the run up where it was, and the tool is run once for
each call, the run ends with one final, and every event has one content."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from aiokafka import AIOKafkaConsumer

from sluice.testing.pipeline_harness import PipelineProcess, new_prefix, publish, sigkill

pytestmark = pytest.mark.integration

TOOLS_MODULE = '''
import os, time
from sluice.tools import tool

@tool(idempotent=False)
def visit(place: str) -> str:
    """Visit a place and say what is there."""
    with open(os.environ["COUNT_FILE"], "a") as f:
        f.write(place + "\\n")
    time.sleep(3)
    return "a quiet harbour with three boats"
'''
VISIT = {
    "type": "function",
    "function": {
        "name": "visit",
        "description": "Visit a place and say what is there.",
        "parameters": {
            "type": "object",
            "properties": {"place": {"type": "string", "maxLength": 20}},
            "required": ["place"],
            "additionalProperties": False,
        },
    },
}


class Service:
    """A `sluice` subprocess (a tool worker or the harness) with its log in a file."""

    def __init__(self, home: Path, *args: str, env: dict[str, str] | None = None):
        self.log_path = home / f"{args[0]}-{uuid.uuid4().hex[:6]}.log"
        self.log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "sluice", *args],
            cwd=home,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
        )

    def wait_for(self, text: str, timeout: float = 90) -> None:
        deadline = time.monotonic() + timeout
        while text.encode() not in self.log_path.read_bytes():
            assert self.proc.poll() is None, self.log_path.read_text()
            assert time.monotonic() < deadline, self.log_path.read_text()
            time.sleep(0.1)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.log.close()


async def events_of(bootstrap: str, prefix: str, run_id: str, until, timeout: float = 300):
    """The run's events on PREFIX.harness-events, read until `until(events)` holds."""
    consumer = AIOKafkaConsumer(
        f"{prefix}.harness-events", bootstrap_servers=bootstrap, auto_offset_reset="earliest"
    )
    await consumer.start()
    events: list[dict] = []
    deadline = time.monotonic() + timeout
    try:
        while not until(events):
            assert time.monotonic() < deadline, events
            batch = await consumer.getmany(timeout_ms=300)
            for records in batch.values():
                events += [json.loads(r.value) for r in records]
            events = [e for e in events if e["run_id"] == run_id]
    finally:
        await consumer.stop()
    return events


async def test_a_run_calls_its_tool_and_answers_through_a_sigkill(bootstrap_servers, tmp_path):
    prefix = new_prefix()
    (tmp_path / "toolmod.py").write_text(TOOLS_MODULE)
    (tmp_path / "tools.json").write_text(json.dumps([VISIT]))
    counted = tmp_path / "count.txt"
    counted.touch()
    kafka = ["--bootstrap-servers", bootstrap_servers, "--topic-prefix", prefix]
    pipeline = PipelineProcess(bootstrap_servers, None, prefix, tmp_path)
    worker = Service(
        tmp_path, "tools", "serve", "toolmod:visit", *kafka, env={"COUNT_FILE": str(counted)}
    )
    harness = Service(tmp_path, "agent", "serve", *kafka)
    services = [worker, harness]
    run_id = f"run-{uuid.uuid4().hex[:8]}"
    try:
        pipeline.wait_ready()
        worker.wait_for("serving ")
        harness.wait_for("harness serving")
        asking = subprocess.Popen(
            [sys.executable, "-m", "sluice", "agent", "run", "What is at the harbour?"]
            + ["--tools", f"@{tmp_path / 'tools.json'}", "--tool-choice", "visit"]
            + ["--max-steps", "3", "--max-tokens", "40", "--run-id", run_id, "--json", *kafka],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

        def calling(events: list[dict]) -> bool:
            return any(e.get("kind") == "tool_call" for e in events)

        await events_of(bootstrap_servers, prefix, run_id, calling)
        await sigkill(harness.proc.pid)  # while the tool runs
        harness.stop()
        harness = Service(tmp_path, "agent", "serve", *kafka)
        services.append(harness)
        out, err = await asyncio.to_thread(asking.communicate, timeout=300)
        assert asking.returncode == 0, (out, err, harness.log_path.read_text())
        events = await events_of(
            bootstrap_servers,
            prefix,
            run_id,
            lambda es: any(e["type"] == "harness_final" for e in es),
        )
        # the same run asked for again: its final is sent again, as it was, and nothing is run;
        # a request that is not a valid run: its asker is told why
        again = {"run_id": run_id, "messages": [{"role": "user", "content": "x"}], "tools": [VISIT]}
        bad = {"run_id": f"{run_id}-bad", "messages": [], "tools": [VISIT]}
        await publish(
            bootstrap_servers,
            f"{prefix}.harness",
            [(run_id.encode(), json.dumps(again).encode()), (b"bad", json.dumps(bad).encode())],
        )

        def finals(es: list[dict]) -> int:
            return sum(e["type"] == "harness_final" for e in es)

        repeated = await events_of(bootstrap_servers, prefix, run_id, lambda es: finals(es) == 2)
        refused = await events_of(bootstrap_servers, prefix, f"{run_id}-bad", finals)
    finally:
        pipeline.stop()
        for service in services:
            service.stop()

    by_seq: dict[int, dict] = {}
    for event in events:
        assert by_seq.setdefault(event["seq"], event) == event, "a seq with two contents"
    assert sorted(by_seq) == list(range(len(by_seq)))
    (final,) = [e for e in by_seq.values() if e["type"] == "harness_final"]
    assert final["stop_reason"] in ("answer", "max_steps") and final["tool_calls"] >= 1
    calls = [
        e["call"] for e in by_seq.values() if e["kind" if "kind" in e else "type"] == "tool_call"
    ]
    results = [e["result"] for e in by_seq.values() if e.get("kind") == "tool_result"]
    assert len(calls) == final["tool_calls"] == len(results)
    assert all(r["ok"] and r["content"] == "a quiet harbour with three boats" for r in results)
    assert len(counted.read_text().split()) == len(calls)  # each call run once, through the kill
    # the client printed the same run: its events as JSON lines, ending with the final
    printed = [json.loads(line) for line in out.splitlines()]
    assert printed[-1] == final and [e["seq"] for e in printed] == sorted(by_seq)
    first, second = [e for e in repeated if e["type"] == "harness_final"]
    assert first == second == final
    assert len(counted.read_text().split()) == len(calls)  # (nothing run for the repeat)
    (why,) = refused
    assert why["stop_reason"] == "error" and "messages" in why["error"]
