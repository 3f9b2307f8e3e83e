"""Writes through Kafka's passing faults: retried while the error is retriable, raised at once
when it is not, and raised after the last attempt."""

from __future__ import annotations

import pytest
from aiokafka.errors import MessageSizeTooLargeError, NotLeaderForPartitionError

from sluice.connectors import retriable
from sluice.connectors.retriable import ATTEMPTS, retrying


@pytest.fixture(autouse=True)
def no_waiting(monkeypatch):
    waits: list[float] = []

    async def sleep(seconds: float) -> None:
        waits.append(seconds)

    monkeypatch.setattr(retriable.asyncio, "sleep", sleep)
    return waits


def failing(errors: list[Exception]):
    calls = []

    async def write() -> str:
        calls.append(1)
        if errors:
            raise errors.pop(0)
        return "written"

    return write, calls


async def test_a_retriable_error_is_waited_out(no_waiting):
    write, calls = failing([NotLeaderForPartitionError(), NotLeaderForPartitionError()])
    assert await retrying(write, "a write") == "written"
    assert len(calls) == 3 and no_waiting == [0.5, 1.0]


async def test_an_error_that_is_not_retriable_is_raised_at_once():
    write, calls = failing([MessageSizeTooLargeError()])
    with pytest.raises(MessageSizeTooLargeError):
        await retrying(write, "a write")
    assert len(calls) == 1


async def test_the_last_retriable_error_is_raised():
    write, calls = failing([NotLeaderForPartitionError() for _ in range(ATTEMPTS)])
    with pytest.raises(NotLeaderForPartitionError):
        await retrying(write, "a write")
    assert len(calls) == ATTEMPTS
