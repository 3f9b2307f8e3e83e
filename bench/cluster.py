"""A deployment of several `sluice run` processes, one role each, on the broker of
`sluice stack up`, for the scale-out benchmarks; and a client that publishes requests and reads
every event with the time its producer stamped it (the record's timestamp: when the runner handed
it over, whatever the client's own batching)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from sluice.connectors.topics import delete_topics_with_prefix
from sluice.testing.pipeline_harness import scrape

ROOT = Path(__file__).resolve().parents[1]
LOGS = ROOT / ".sluice" / "bench-logs"


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    if not values:
        return float("nan")
    k = (len(values) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(values) - 1)
    return values[lo] + (values[hi] - values[lo]) * (k - lo)


def total(samples: dict[str, list], name: str) -> float:
    return sum(v for _, v in samples.get(name, []))


@dataclass
class Process:
    name: str
    proc: subprocess.Popen
    log_path: Path
    port: int  # its metrics

    def text(self) -> str:
        return self.log_path.read_text(errors="replace")


class Cluster:
    """`sluice run --role ...` processes sharing a topic prefix of their own."""

    def __init__(self, bootstrap: str, engine_args: list[str]):
        self.bootstrap = bootstrap
        self.prefix = f"bench{uuid.uuid4().hex[:8]}"
        self.engine_args = engine_args
        self.processes: dict[str, Process] = {}
        LOGS.mkdir(parents=True, exist_ok=True)

    def start(self, name: str, role: str, *args: str, env: dict | None = None) -> Process:
        port = free_port()
        cmd = [sys.executable, "-m", "sluice", "run", "--role", role, "--no-sessions"]
        cmd += ["--bootstrap-servers", self.bootstrap, "--topic-prefix", self.prefix]
        cmd += ["--metrics-port", str(port), *self.engine_args, *args]
        log_path = LOGS / f"{self.prefix}-{name}.log"
        with open(log_path, "wb") as out:
            proc = subprocess.Popen(
                cmd, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}
            )
        process = self.processes[name] = Process(name, proc, log_path, port)
        return process

    def wait_ready(self, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        for p in self.processes.values():
            while " up: reading " not in p.text():
                if p.proc.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit(f"{p.name} did not start; see {p.log_path}")
                time.sleep(0.3)

    async def wait_runners(self, scheduler: str, count: int, timeout: float = 60) -> None:
        """Until the scheduler has heard `count` runners' KV events."""
        deadline = time.monotonic() + timeout
        port = self.processes[scheduler].port
        while total(scrape(port), "sluice_runners_live") < count:
            if time.monotonic() > deadline:
                raise SystemExit(f"{scheduler} did not hear {count} runners")
            await asyncio.sleep(0.3)

    async def stop(self) -> None:
        """The processes stopped (SIGTERM, then SIGKILL after 90 s), then the run's topics
        deleted."""
        for p in self.processes.values():
            if p.proc.poll() is None:
                p.proc.send_signal(signal.SIGTERM)
        for p in self.processes.values():
            try:
                p.proc.wait(90)
            except subprocess.TimeoutExpired:
                p.proc.kill()
                p.proc.wait(30)
        await delete_topics_with_prefix(self.bootstrap, self.prefix)


@dataclass
class Stream:
    """What the client read of one request: its token events' producer timestamps (seconds) and
    its final event."""

    sent: float = 0.0
    token_times: list[float] = field(default_factory=list)
    seqs: set[int] = field(default_factory=set)
    final: dict | None = None
    final_read: float = 0.0  # when the client read it


class Client:
    """A plain aiokafka producer of requests and consumer of the tokens topic."""

    def __init__(self, bootstrap: str, prefix: str):
        from aiokafka import AIOKafkaConsumer, AIOKafkaProducer

        self.prefix = prefix
        self.producer = AIOKafkaProducer(bootstrap_servers=bootstrap, linger_ms=0)
        self.consumer = AIOKafkaConsumer(
            f"{prefix}.tokens",
            bootstrap_servers=bootstrap,
            auto_offset_reset="earliest",
            enable_auto_commit=False,
        )
        self.streams: dict[str, Stream] = defaultdict(Stream)

    async def __aenter__(self) -> Client:
        await self.producer.start()
        await self.consumer.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.producer.stop()
        await self.consumer.stop()

    async def publish(self, bodies: list[dict]) -> None:
        for body in bodies:
            self.streams[body["request_id"]].sent = time.time()
            value = json.dumps(body).encode()
            await self.producer.send(
                f"{self.prefix}.requests", key=body["request_id"].encode(), value=value
            )
        await self.producer.flush()

    async def wait(self, ids: set[str], timeout: float = 600) -> None:
        """Read until every request in `ids` has its final event; an error event ends the run."""
        deadline = time.monotonic() + timeout
        while not all(self.streams[rid].final is not None for rid in ids):
            if time.monotonic() > deadline:
                missing = [rid for rid in ids if self.streams[rid].final is None]
                raise SystemExit(f"no final event for {len(missing)} requests: {missing[:5]}")
            batch = await self.consumer.getmany(timeout_ms=200)
            for records in batch.values():
                for record in records:
                    event = json.loads(record.value)
                    stream = self.streams[event["request_id"]]
                    if event["type"] == "token":
                        if event["seq"] not in stream.seqs:  # a copy after a restart: once
                            stream.seqs.add(event["seq"])
                            stream.token_times.append(record.timestamp / 1000)
                    elif event["type"] == "final":
                        stream.final = event
                        stream.final_read = time.time()
                    else:
                        raise SystemExit(f"error event: {event}")


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown"
