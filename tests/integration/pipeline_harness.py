"""Run `sluice run` processes against the real broker and talk to them as a client would: with a
plain aiokafka producer and consumer written here, not sluice's connectors."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer

ENGINE_FLAGS = ["--kv-cache-mb", "256", "--max-num-batched-tokens", "512"]


def new_prefix() -> str:
    return f"t{uuid.uuid4().hex[:10]}"


class PipelineProcess:
    """One `sluice run` process; its log goes to a file for the test's failure message."""

    def __init__(self, bootstrap: str, redis_url: str | None, prefix: str, log_dir: Path, *extra: str,
                 name: str = "pipeline"):
        self.log_path = log_dir / f"{name}-{uuid.uuid4().hex[:6]}.log"
        args = [sys.executable, "-m", "sluice", "run", "--bootstrap-servers", bootstrap,
                "--topic-prefix", prefix, "--partitions", "4", *ENGINE_FLAGS, *extra]
        args += ["--redis-url", redis_url] if redis_url else ["--no-sessions"]
        self.log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(args, stdout=self.log, stderr=subprocess.STDOUT, env=os.environ.copy())

    def wait_ready(self, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if "pipeline" in self.tail() and " up: reading " in self.tail():
                return
            if self.proc.poll() is not None:
                raise AssertionError(f"sluice run exited with {self.proc.returncode}:\n{self.tail()}")
            time.sleep(0.3)
        raise AssertionError(f"sluice run not ready in {timeout} s:\n{self.tail()}")

    def tail(self, n: int = 60) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])

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
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, enable_idempotence=True)
    await producer.start()
    try:
        for key, value in messages:
            await producer.send(topic, key=key, value=value)
        await producer.flush()
    finally:
        await producer.stop()


def request(request_id: str, **fields) -> tuple[bytes, bytes]:
    body = {"request_id": request_id, **fields}
    key = (fields.get("session_id") or request_id).encode()
    return key, json.dumps(body).encode()


@dataclass
class Streams:
    """Every event read from the tokens topic, grouped by request id."""

    events: dict[str, list[dict]] = field(default_factory=lambda: defaultdict(list))
    dead_letters: list[dict] = field(default_factory=list)

    def finals(self, rid: str) -> list[dict]:
        return [e for e in self.events[rid] if e["type"] in ("final", "error")]

    def text(self, rid: str) -> str:
        """Text of completion 0, keeping the highest-seq copy of each event (duplicates dropped)."""
        by_seq = {e["seq"]: e for e in self.events[rid] if e["type"] == "token" and e.get("index", 0) == 0}
        return "".join(by_seq[s]["text"] for s in sorted(by_seq))


async def collect(bootstrap: str, prefix: str, expected: set[str], timeout: float = 300,
                  dlq_expected: int = 0, streams: Streams | None = None) -> Streams:
    """Read the tokens and dead-letter topics until every expected request has a final or error
    event and `dlq_expected` dead letters arrived."""
    streams = streams or Streams()
    consumer = AIOKafkaConsumer(f"{prefix}.tokens", f"{prefix}.dlq", bootstrap_servers=bootstrap,
                                auto_offset_reset="earliest", enable_auto_commit=False,
                                metadata_max_age_ms=1000)
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

    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, group_id=None, enable_auto_commit=False)
    await consumer.start()
    try:
        from aiokafka.admin import AIOKafkaAdminClient

        admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
        await admin.start()
        try:
            partitions = [TopicPartition(topic, p) for p in consumer.partitions_for_topic(topic) or []]
            if not partitions:
                await consumer.topics()
                partitions = [TopicPartition(topic, p) for p in consumer.partitions_for_topic(topic) or []]
            ends = await consumer.end_offsets(partitions)
            loop = asyncio.get_running_loop()
            deadline = loop.time() + timeout
            while loop.time() < deadline:
                offsets = await admin.list_consumer_group_offsets(group)
                if all(offsets.get(tp) is not None and offsets[tp].offset >= ends[tp] for tp in partitions):
                    return True
                await asyncio.sleep(0.5)
            return False
        finally:
            await admin.close()
    finally:
        await consumer.stop()
