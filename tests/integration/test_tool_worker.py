"""`sluice tools serve` on the real broker: calls published as plain Kafka records are answered on
PREFIX.tool-results; a call delivered twice is run once and answered alike; bad arguments, an
unknown tool and a failing program are answers, not stalls; and a worker SIGKILLed while running a
tool that is not idempotent is never made to run it twice: its successor answers "interrupted"."""

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

from sluice.schemas.tool_messages import ToolCallMessage, ToolResultMessage
from sluice.testing.pipeline_harness import new_prefix, publish, sigkill

pytestmark = pytest.mark.integration

TOOLS_MODULE = '''
import os, time
from sluice.tools import tool

@tool
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b

@tool(idempotent=False)
def count(label: str, seconds: float = 0.0) -> str:
    """Record a visit (the worker's own count of runs), after a pause."""
    with open(os.environ["COUNT_FILE"], "a") as f:
        f.write(label + "\\n")
    time.sleep(seconds)
    return "counted " + label

tools = [add, count]
'''


class Worker:
    def __init__(self, bootstrap: str, prefix: str, home: Path, count_file: Path):
        self.log = open(home / f"worker-{uuid.uuid4().hex[:6]}.log", "wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "sluice", "tools", "serve", "toolmod:tools"]
            + ["sluice.tools.python_tool:python", "--bootstrap-servers", bootstrap]
            + ["--topic-prefix", prefix],
            cwd=home,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "COUNT_FILE": str(count_file)},
        )

    def wait_ready(self, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while b"serving " not in Path(self.log.name).read_bytes():
            assert self.proc.poll() is None, Path(self.log.name).read_text()
            assert time.monotonic() < deadline, Path(self.log.name).read_text()
            time.sleep(0.1)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(30)
        self.log.close()


def call(prefix: str, key: str, name: str, arguments: dict, tool: str | None = None):
    message = ToolCallMessage(
        key=key, request_id="r-1", call_id=f"call-{key}", name=name, arguments=json.dumps(arguments)
    )
    topic = f"{prefix}.tools.{tool or name}"
    return topic, (key.encode(), message.model_dump_json().encode())


async def send(bootstrap: str, calls) -> None:
    for topic, record in calls:
        await publish(bootstrap, topic, [record])


async def results(bootstrap: str, prefix: str, want: dict[str, int], timeout: float = 120):
    """Every result on PREFIX.tool-results, once each key has `want[key]` of them."""
    consumer = AIOKafkaConsumer(
        f"{prefix}.tool-results",
        bootstrap_servers=bootstrap,
        auto_offset_reset="earliest",
        isolation_level="read_committed",
    )
    await consumer.start()
    got: dict[str, list[ToolResultMessage]] = {}
    deadline = time.monotonic() + timeout
    try:
        while any(len(got.get(k, [])) < n for k, n in want.items()):
            assert time.monotonic() < deadline, f"results so far: {got}"
            batch = await consumer.getmany(timeout_ms=500)
            for records in batch.values():
                for record in records:
                    result = ToolResultMessage.model_validate_json(record.value)
                    got.setdefault(result.key, []).append(result)
    finally:
        await consumer.stop()
    return got


async def wait_for(predicate, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline
        await asyncio.sleep(0.1)


async def test_tool_calls_are_answered_once_whatever_stops_the_worker(bootstrap_servers, tmp_path):
    prefix = new_prefix()
    (tmp_path / "toolmod.py").write_text(TOOLS_MODULE)
    counted = tmp_path / "count.txt"
    counted.touch()
    worker = Worker(bootstrap_servers, prefix, tmp_path, counted)
    try:
        await asyncio.to_thread(worker.wait_ready)
        await send(
            bootstrap_servers,
            [
                call(prefix, "k-add", "add", {"a": 2, "b": 3}),
                call(prefix, "k-add", "add", {"a": 2, "b": 3}),  # the same call, again
                call(prefix, "k-bad", "add", {"a": "two", "b": 3}),
                call(prefix, "k-none", "subtract", {"a": 1}, tool="add"),
                call(prefix, "k-count", "count", {"label": "once"}),
                call(prefix, "k-count", "count", {"label": "once"}),
                call(prefix, "k-py", "python", {"code": "print(6 * 7)"}),
                call(prefix, "k-escape", "python", {"code": "print(open('/etc/passwd').read())"}),
            ],
        )
        got = await results(
            bootstrap_servers,
            prefix,
            {"k-add": 2, "k-bad": 1, "k-none": 1, "k-count": 2, "k-py": 1, "k-escape": 1},
        )
        assert [(r.ok, r.content) for r in got["k-add"]] == [(True, "5"), (True, "5")]
        (bad,) = got["k-bad"]
        assert not bad.ok and bad.error == "invalid_arguments" and "a:" in bad.content
        (none,) = got["k-none"]
        assert not none.ok and none.error == "unknown_tool"
        assert [r.content for r in got["k-count"]] == ["counted once", "counted once"]
        assert counted.read_text().split() == ["once"]  # run once for the two deliveries
        (py,) = got["k-py"]
        assert py.ok and py.content == "42\n" and py.call_id == "call-k-py"
        (escape,) = got["k-escape"]
        assert not escape.ok and escape.error == "failed" and "No such file" in escape.content

        # SIGKILL the worker while a tool that is not idempotent runs
        await send(
            bootstrap_servers, [call(prefix, "k-slow", "count", {"label": "slow", "seconds": 60})]
        )
        await wait_for(lambda: "slow" in counted.read_text().split())
        await sigkill(worker.proc.pid)
        worker.stop()
        worker = Worker(bootstrap_servers, prefix, tmp_path, counted)
        await asyncio.to_thread(worker.wait_ready)
        await send(bootstrap_servers, [call(prefix, "k-after", "add", {"a": 1, "b": 1})])
        got = await results(bootstrap_servers, prefix, {"k-slow": 1, "k-after": 1})
        (slow,) = got["k-slow"]
        assert not slow.ok and slow.error == "interrupted"
        assert counted.read_text().split() == ["once", "slow"]  # not run a second time
        assert got["k-after"][0].content == "2"  # and the new worker serves on
    finally:
        worker.stop()
