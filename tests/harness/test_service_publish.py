"""The harness service's publishing: a retriable Kafka error (a partition's leader moving, as on a
broker just started) is waited out and the records sent again; one that is not is raised, for the
run to end with it. (A stand-in producer: the broker's part is the integration tests'.)"""

from __future__ import annotations

import asyncio

import pytest
from aiokafka.errors import MessageSizeTooLargeError, NotLeaderForPartitionError

from sluice.harness import service
from sluice.harness.service import HarnessService


class FlakyProducer:
    def __init__(self, failures: list[Exception]):
        self.failures = failures
        self.sent: list[tuple[str, str, bytes]] = []

    async def send(self, topic: str, key: str, value: bytes):
        future = asyncio.get_running_loop().create_future()
        if self.failures:
            future.set_exception(self.failures.pop(0))
        else:
            self.sent.append((topic, key, value))
            future.set_result(None)
        return future


async def test_a_retriable_error_is_waited_out_and_the_records_sent_again(monkeypatch):
    waited, sleep = [], asyncio.sleep

    def no_wait(seconds: float):
        waited.append(seconds)
        return sleep(0)

    monkeypatch.setattr(service.asyncio, "sleep", no_wait)
    harness = HarnessService("unused:9092", "p")
    harness._producer = FlakyProducer([NotLeaderForPartitionError(), NotLeaderForPartitionError()])
    await harness._publish([("p.events", "run-1", {"a": 1})])
    assert harness._producer.sent == [("p.events", "run-1", b'{"a":1}')]
    assert waited == [0.5, 1.0]


async def test_an_error_that_is_not_retriable_is_raised():
    harness = HarnessService("unused:9092", "p")
    harness._producer = FlakyProducer([MessageSizeTooLargeError()])
    with pytest.raises(MessageSizeTooLargeError):
        await harness._publish([("p.events", "run-1", {"a": 1})])
