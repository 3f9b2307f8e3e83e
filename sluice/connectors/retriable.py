"""Writing through Kafka's passing faults: a partition's leader moving, a broker restarting."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar

from aiokafka.errors import KafkaError

log = logging.getLogger(__name__)

T = TypeVar("T")

ATTEMPTS = 6  # a retriable error waited out over about 15 s (0.5 s, doubling)


async def retrying(write: Callable[[], Awaitable[T]], what: str) -> T:
    """`write()`, made again after a retriable error (the caller makes writing twice harmless:
    records taken once by their names, a changelog's key written again with the same value).
    An error that is not retriable (a record over the size limit), or the last one, is raised."""
    for attempt in range(ATTEMPTS):
        try:
            return await write()
        except KafkaError as e:
            if not e.retriable or attempt == ATTEMPTS - 1:
                raise
            log.warning("%s failed (%s): trying again", what, e)
            await asyncio.sleep(0.5 * 2**attempt)
    raise AssertionError("unreachable")
