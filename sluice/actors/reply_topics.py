"""Which topics a client may name as its `reply_topic`, and whether one exists, decided before
anything is sent there.

A reply topic must match the configured pattern (default `PREFIX.replies.*`, shell-style) and may
never be one of the pipeline's own topics (requests, dead letters, progress, internal). It must
exist, or be created when the pipeline is configured to create reply topics: producing to a
topic that does not exist would block on its metadata for the producer's whole timeout and stall
every request behind it. A request that fails either check gets an error event at once, on the
default tokens topic.

Existence is asked of the broker once per topic; a missing topic is asked again after a few
seconds (a client may create it meanwhile).
"""

from __future__ import annotations

import asyncio
import fnmatch
import logging
import time

from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.errors import UnknownTopicOrPartitionError, for_code

from sluice.connectors.kafka_security import kafka_client_options
from sluice.connectors.topics import ensure_topics

log = logging.getLogger(__name__)

MISSING_RECHECK_S = 5.0


class ReplyTopics:
    def __init__(
        self,
        bootstrap_servers: str,
        pattern: str,
        reserved: set[str],
        *,
        create: bool = False,
        partitions: int = 1,
        timeout_s: float = 5.0,
    ):
        self.bootstrap_servers = bootstrap_servers
        self.pattern = pattern
        self.reserved = set(reserved)
        self.create = create
        self.partitions = partitions
        self.timeout_s = timeout_s
        self._exists: set[str] = set()
        self._missing_until: dict[str, float] = {}  # topic -> when to ask the broker again
        self._admin: AIOKafkaAdminClient | None = None
        self._lock = asyncio.Lock()

    async def stop(self) -> None:
        if self._admin is not None:
            admin, self._admin = self._admin, None
            await admin.close()

    def allowed(self, topic: str) -> str | None:
        """None when the pattern allows the topic, else why not."""
        if topic in self.reserved or not fnmatch.fnmatchcase(topic, self.pattern):
            return f"{topic!r} is not an allowed reply topic (allowed: {self.pattern})"
        return None

    async def check(self, topic: str) -> str | None:
        """None when events may go to `topic`, else the reason they may not (for the client)."""
        why = self.allowed(topic)
        if why is not None or topic in self._exists:
            return why
        if time.monotonic() < self._missing_until.get(topic, 0.0):
            return f"topic {topic!r} does not exist"
        async with self._lock:
            try:
                exists = await self._exists_on_broker(topic)
            except Exception as exc:  # noqa: BLE001 - cannot tell now: let the producer decide
                log.warning("could not ask the broker whether %s exists: %s", topic, exc)
                return None
            if exists:
                self._exists.add(topic)
                return None
            if self.create:
                await ensure_topics(
                    self.bootstrap_servers, {topic: self.partitions}, timeout=self.timeout_s
                )
                log.info("created reply topic %s", topic)
                self._exists.add(topic)
                return None
            self._missing_until[topic] = time.monotonic() + MISSING_RECHECK_S
            return f"topic {topic!r} does not exist"

    async def _exists_on_broker(self, topic: str) -> bool:
        if self._admin is None:
            self._admin = AIOKafkaAdminClient(
                bootstrap_servers=self.bootstrap_servers,
                request_timeout_ms=int(self.timeout_s * 1000),
                **kafka_client_options(),
            )
            await self._admin.start()
        (described,) = await self._admin.describe_topics([topic])
        error = for_code(described["error_code"])
        if error is UnknownTopicOrPartitionError:
            return False
        return described["error_code"] == 0 and bool(described["partitions"])
