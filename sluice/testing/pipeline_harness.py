"""Run `sluice run` processes against the real broker and talk to them as a client would: with a
plain aiokafka producer and consumer written here, not sluice's connectors."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis.asyncio as aioredis
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer

from sluice.connectors.processes import pid_alive, port_is_free
from sluice.connectors.sessions import session_key
from sluice.connectors.settings import StackSettings

# float32 and unquantized, as the in-process engines the tests compare with (the CLI's default
# dtype is measured, and its default quantization runs the default GGUF's 4-bit layers as stored)
ENGINE_FLAGS = ["--kv-cache-mb", "256", "--max-num-batched-tokens", "512", "--dtype", "float32"]
ENGINE_FLAGS += ["--quantization", "none"]


def new_prefix() -> str:
    return f"t{uuid.uuid4().hex[:10]}"


class PipelineProcess:
    """One `sluice run` process; its log goes to a file for the test's failure message."""

    def __init__(
        self,
        bootstrap: str,
        redis_url: str | None,
        prefix: str,
        log_dir: Path,
        *extra: str,
        name: str = "pipeline",
        env: dict[str, str] | None = None,
        group: str | None = None,
    ):
        self.name = name
        self.log_path = log_dir / f"{name}-{uuid.uuid4().hex[:6]}.log"
        # A consumer group of the test's own (default: the topic prefix; roles append -ROLE): a
        # shared group would rebalance with every other `sluice run` on the same broker.
        args = [
            sys.executable,
            "-m",
            "sluice",
            "run",
            "--bootstrap-servers",
            bootstrap,
            "--topic-prefix",
            prefix,
            "--group",
            group or prefix,
            "--partitions",
            "4",
            *ENGINE_FLAGS,
            *extra,
        ]
        args += ["--redis-url", redis_url] if redis_url else ["--no-sessions"]
        self.log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            args, stdout=self.log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}
        )

    @property
    def pid(self) -> int:
        return self.proc.pid

    def text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if "pipeline" in self.tail() and " up: reading " in self.tail():
                return
            if self.proc.poll() is not None:
                raise AssertionError(
                    f"sluice run exited with {self.proc.returncode}:\n{self.tail()}"
                )
            time.sleep(0.3)
        raise AssertionError(f"sluice run not ready in {timeout} s:\n{self.tail()}")

    def tail(self, n: int = 60) -> str:
        return f"--- {self.name} ---\n" + "\n".join(self.text().splitlines()[-n:])

    def proc_status(self, field: str) -> int:
        """A memory figure of the process from /proc/PID/status (VmRSS, VmHWM, ...), in KiB."""
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
        raise KeyError(field)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(30)

    def stop(self, timeout: float = 90) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(30)
        self.log.close()
        return self.proc.returncode


async def publish(bootstrap: str, topic: str, messages: list[tuple[bytes | None, bytes]]) -> None:
    producer = AIOKafkaProducer(
        bootstrap_servers=bootstrap, enable_idempotence=True, max_request_size=8 << 20
    )
    await producer.start()
    try:
        for key, value in messages:
            await producer.send(topic, key=key, value=value)
        await producer.flush()
    finally:
        await producer.stop()


TOPICS = [
    "the sea",
    "mountains",
    "a robot",
    "coffee",
    "the moon",
    "trains",
    "cats",
    "rain",
    "bread",
    "music",
]


def fifty_requests() -> list[dict]:
    """The acceptance workload: 50 greedy requests, a third of them chat, 8 to 16 tokens each."""
    out = []
    for i in range(50):
        topic = TOPICS[i % len(TOPICS)]
        fields: dict[str, Any]
        if i % 3 == 0:
            fields = {
                "messages": [{"role": "user", "content": f"Write one sentence about {topic}."}]
            }
        else:
            fields = {"prompt": f"Request {i}: a short note about {topic} says"}
        out.append(
            {"request_id": f"req-{i:02d}", "temperature": 0, "max_tokens": 8 + i % 9, **fields}
        )
    return out


def request(request_id: str, **fields) -> tuple[bytes, bytes]:
    body = {"request_id": request_id, **fields}
    key = (fields.get("session_id") or request_id).encode()
    return key, json.dumps(body).encode()


def terminal(event: dict) -> bool:
    """A request's last event: sluice's final or error, or OpenAI's last object (the one with
    the usage) or error object."""
    return event.get("type") in ("final", "error") or "usage" in event or "error" in event


@dataclass
class Streams:
    """Every event read from the tokens topic, grouped by request id."""

    events: dict[str, list[dict]] = field(default_factory=lambda: defaultdict(list))
    dead_letters: list[dict] = field(default_factory=list)

    def finals(self, rid: str) -> list[dict]:
        return [e for e in self.events[rid] if terminal(e)]

    def text(self, rid: str) -> str:
        """Text of completion 0, keeping the highest-seq copy of each event (duplicates dropped)."""
        by_seq = {
            e["seq"]: e for e in self.events[rid] if e["type"] == "token" and e.get("index", 0) == 0
        }
        return "".join(by_seq[s]["text"] for s in sorted(by_seq))


def output_consumer(
    bootstrap: str, prefix: str, isolation_level: str = "read_uncommitted"
) -> AIOKafkaConsumer:
    """A consumer of the pipeline's tokens and dead-letter topics from their start, committing
    nothing."""
    return AIOKafkaConsumer(
        f"{prefix}.tokens",
        f"{prefix}.dlq",
        bootstrap_servers=bootstrap,
        auto_offset_reset="earliest",
        enable_auto_commit=False,
        metadata_max_age_ms=1000,
        isolation_level=isolation_level,
    )


async def collect(
    bootstrap: str,
    prefix: str,
    expected: set[str],
    timeout: float = 300,
    dlq_expected: int = 0,
    streams: Streams | None = None,
) -> Streams:
    """Read the tokens and dead-letter topics until every expected request has a final or error
    event and `dlq_expected` dead letters arrived."""
    streams = streams or Streams()
    consumer = output_consumer(bootstrap, prefix)
    await consumer.start()
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    try:
        while loop.time() < deadline:
            done = {rid for rid in expected if streams.finals(rid)}
            if done >= expected and len(streams.dead_letters) >= dlq_expected:
                break
            batch = await consumer.getmany(timeout_ms=500)
            for tp, records in batch.items():
                for record in records:
                    event = json.loads(record.value)
                    if tp.topic.endswith(".dlq"):
                        streams.dead_letters.append(event)
                    else:
                        streams.events[event["request_id"]].append(event)
    finally:
        await consumer.stop()
    return streams


async def committed_everything(bootstrap: str, topic: str, group: str, timeout: float = 30) -> bool:
    """True once the group's committed offsets reach the end of every partition of topic."""
    from aiokafka import TopicPartition

    consumer = AIOKafkaConsumer(
        bootstrap_servers=bootstrap, group_id=None, enable_auto_commit=False
    )
    await consumer.start()
    try:
        from aiokafka.admin import AIOKafkaAdminClient

        admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
        await admin.start()
        try:
            loop = asyncio.get_running_loop()
            deadline = loop.time() + timeout
            # The partitions from the broker itself (a consumer that subscribed to nothing has no
            # metadata of the topic): never vacuously true.
            (described,) = await admin.describe_topics([topic])
            partitions = [TopicPartition(topic, p["partition"]) for p in described["partitions"]]
            assert partitions, f"{topic} has no partitions: {described}"
            ends = await consumer.end_offsets(partitions)
            starts = await consumer.beginning_offsets(partitions)
            while loop.time() < deadline:
                offsets = await admin.list_consumer_group_offsets(group)
                if all(
                    ends[tp] == starts[tp]  # nothing to commit there
                    or (offsets.get(tp) is not None and offsets[tp].offset >= ends[tp])
                    for tp in partitions
                ):
                    return True
                await asyncio.sleep(0.5)
            return False
        finally:
            await admin.close()
    finally:
        await consumer.stop()


async def settled_session(redis_url: str, tenant: str, session_id: str, turns: int) -> dict:
    """A session's record once it holds `turns` turns and none is in flight. A turn is recorded
    after its final event is durable, so a client that has read the final may, for a moment,
    still see the record without it (the session's next turn waits for it: `pending`)."""
    client = aioredis.Redis.from_url(redis_url)
    deadline = time.monotonic() + 60
    try:
        while True:
            raw = await client.get(session_key(tenant, session_id))
            record = None if raw is None else json.loads(raw)
            if record is not None and record["turns"] == turns and record["pending"] is None:
                return record
            assert time.monotonic() < deadline, f"session {tenant}/{session_id}: {record}"
            await asyncio.sleep(0.1)
    finally:
        await client.aclose()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def restartable_port() -> int:
    """A free port below the kernel's range of ephemeral ports: once the server on it is killed,
    no other process's outgoing connection can be given it as its own end before the server
    starts again on it (a port from `free_port` can be, and the restart then fails)."""
    low = 32768
    with contextlib.suppress(OSError, ValueError):
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    rng = random.SystemRandom()
    for _ in range(100):
        port = rng.randrange(10000, low) if low > 11000 else free_port()
        if port_is_free("127.0.0.1", port):
            return port
    return free_port()


def private_stack(home: Path) -> StackSettings:
    """A broker and a Redis of one's own (to kill and start again), on free ports outside the
    ephemeral range, Redis syncing every write."""
    return StackSettings(
        home=home,
        kafka_port=restartable_port(),
        kafka_controller_port=restartable_port(),
        redis_port=restartable_port(),
        redis_appendfsync="always",
    )


async def sigkill(pid: int | None) -> None:
    """SIGKILL, and wait until the process is gone (its ports free again)."""
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    for _ in range(200):
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)  # a broker started from here is our child: reap it
        if not pid_alive(pid):
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"pid {pid} survived SIGKILL")


def scrape(port: int) -> dict[str, list]:
    """The process's Prometheus metrics: sample name -> [(labels, value), ...]."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    samples: dict[str, list] = defaultdict(list)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[sample.name].append((sample.labels, sample.value))
    return samples


def value(
    samples: dict[str, list], name: str, default: float | None = None, **labels: str
) -> float:
    """The one sample of `name` whose labels include `labels` (`default` when there is none)."""
    found = [v for ls, v in samples.get(name, []) if all(ls.get(k) == w for k, w in labels.items())]
    if not found and default is not None:
        return default
    assert len(found) == 1, (name, labels, samples.get(name))
    return found[0]


class Watcher:
    """Reads the tokens and dead-letter topics in the background into `streams`, so a test can
    act (kill a process, publish the next turn) the moment a condition holds."""

    def __init__(self, bootstrap: str, prefix: str, isolation_level: str = "read_uncommitted"):
        self.bootstrap = bootstrap
        self.streams = Streams()
        self.records = 0
        self._consumer = output_consumer(bootstrap, prefix, isolation_level)
        self._task: asyncio.Task | None = None

    async def __aenter__(self) -> Watcher:
        await self._consumer.start()
        self._task = asyncio.ensure_future(self._read())
        return self

    async def __aexit__(self, *exc_info) -> None:
        assert self._task is not None  # started by __aenter__
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)
        await self._consumer.stop()

    async def _read(self) -> None:
        while True:
            batch = await self._consumer.getmany(timeout_ms=200)
            for tp, records in batch.items():
                for record in records:
                    self.records += 1
                    event = json.loads(record.value)
                    if tp.topic.endswith(".dlq"):
                        self.streams.dead_letters.append(event)
                    else:
                        self.streams.events[event["request_id"]].append(event)

    async def wait_for(self, condition, timeout: float, what: str = "condition") -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        assert self._task is not None, "use the Watcher in `async with`"
        while not condition(self.streams):
            if self._task.done():
                self._task.result()
            if loop.time() > deadline:
                raise AssertionError(f"timed out after {timeout} s waiting for {what}")
            await asyncio.sleep(0.05)

    async def caught_up(self, timeout: float = 30) -> Streams:
        """Wait until every event written so far has been read (e.g. right after a SIGKILL, to know
        exactly which events the killed process got out)."""
        probe = AIOKafkaConsumer(bootstrap_servers=self.bootstrap, enable_auto_commit=False)
        await probe.start()
        try:
            partitions = list(self._consumer.assignment())
            ends = await probe.end_offsets(partitions)
        finally:
            await probe.stop()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        # The consumer's position, not the last record read: under read_committed the records of
        # aborted transactions and the transaction markers are skipped, never read.
        for tp, end in ends.items():
            while await self._consumer.position(tp) < end:
                if loop.time() > deadline:
                    raise AssertionError(f"the watcher did not read {tp} up to {end}")
                await asyncio.sleep(0.05)
        return self.streams

    async def wait_finals(self, expected: set[str], timeout: float) -> Streams:
        await self.wait_for(
            lambda s: all(s.finals(rid) for rid in expected),
            timeout,
            f"final events of {len(expected)} requests",
        )
        return self.streams
