"""Creating the pipeline's topics with the partition counts it is configured for (and deleting
a run's topics by their prefix, for benchmarks).

The broker of the local stack does not create topics on first use (and production brokers
often must not), so the pipeline creates its own at start. Running it again is harmless: topics
that exist are left alone.

An existing topic with *fewer* partitions than configured is logged as a warning, not raised and
not grown. Growing it would move keys to other partitions, which breaks the per-session order and
runner affinity the pipeline relies on; that is an operator's decision (`kafka-topics --alter`),
and the pipeline runs correctly, only with less parallelism, on fewer partitions.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping

from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import TopicAlreadyExistsError, UnknownTopicOrPartitionError, for_code

from sluice.connectors.kafka_security import kafka_client_options

log = logging.getLogger(__name__)


class TopicSetupError(RuntimeError):
    """A topic could not be created or described."""


async def ensure_topics(
    bootstrap_servers: str,
    topics: Mapping[str, int],
    replication_factor: int = 1,
    *,
    config: Mapping[str, str] | None = None,
    timeout: float = 30.0,
) -> dict[str, int]:
    """Create the missing topics of `{name: partitions}`; return every topic's partition count.

    Returns only once each topic's partitions have leaders, so producers and consumers started
    right after do not see "unknown topic" errors. `config` applies to topics created here.
    """
    admin = _admin(bootstrap_servers, timeout)
    await admin.start()
    try:
        existing = await _partition_counts(admin, list(topics))
        missing = [name for name in topics if name not in existing]
        if missing:
            new = [
                NewTopic(
                    name,
                    num_partitions=topics[name],
                    replication_factor=replication_factor,
                    topic_configs=dict(config or {}),
                )
                for name in missing
            ]
            response = await admin.create_topics(new, timeout_ms=int(timeout * 1000))
            for name, code, message in _topic_errors(response):
                error = for_code(code)
                if code == 0:
                    log.info(
                        "created topic %s with %d partition(s), replication factor %d",
                        name,
                        topics[name],
                        replication_factor,
                    )
                elif error is not TopicAlreadyExistsError:  # that one: created by a peer meanwhile
                    raise TopicSetupError(
                        f"creating topic {name!r} failed: {error.__name__}: {message}"
                    )
        counts = await _wait_until_ready(admin, list(topics), timeout)
    finally:
        await admin.close()
    for name, wanted in topics.items():
        if counts[name] < wanted:
            log.warning(
                "topic %s has %d partition(s), fewer than the %d configured: running with "
                "less parallelism (add partitions with kafka-topics --alter if wanted; "
                "this moves keys, so do it while the topic is idle)",
                name,
                counts[name],
                wanted,
            )
    return counts


def _admin(bootstrap_servers: str, timeout: float) -> AIOKafkaAdminClient:
    return AIOKafkaAdminClient(
        bootstrap_servers=bootstrap_servers,
        request_timeout_ms=int(timeout * 1000),
        **kafka_client_options(),
    )


async def _partition_counts(
    admin: AIOKafkaAdminClient, names: list[str], need_leaders: bool = False
) -> dict[str, int]:
    """Partition counts of the given topics that exist (with leaders, when asked)."""
    found = {}
    for topic in await admin.describe_topics(names):
        error = for_code(topic["error_code"])
        if error is UnknownTopicOrPartitionError or (
            topic["error_code"] == 0 and not topic["partitions"]
        ):
            continue
        if topic["error_code"] not in (0, 5):  # 5: LEADER_NOT_AVAILABLE just after creation
            raise TopicSetupError(f"describing topic {topic['topic']!r} failed: {error.__name__}")
        partitions = topic["partitions"]
        if need_leaders and (
            topic["error_code"] != 0
            or any(p["error_code"] != 0 or p["leader"] < 0 for p in partitions)
        ):
            continue
        found[topic["topic"]] = len(partitions)
    return found


async def _wait_until_ready(
    admin: AIOKafkaAdminClient, names: list[str], timeout: float
) -> dict[str, int]:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        counts = await _partition_counts(admin, names, need_leaders=True)
        if len(counts) == len(names):
            return counts
        if loop.time() > deadline:
            waiting = sorted(set(names) - set(counts))
            raise TopicSetupError(f"topics {waiting} have no leaders after {timeout:.0f}s")
        await asyncio.sleep(0.1)


def _topic_errors(response) -> list[tuple[str, int, str | None]]:
    # CreateTopicsResponse v1+ carries (topic, error_code, error_message); v0 lacks the message.
    return [
        (item[0], item[1], item[2] if len(item) > 2 else None) for item in response.topic_errors
    ]


async def delete_topics_with_prefix(
    bootstrap_servers: str, prefix: str, timeout: float = 30.0
) -> list[str]:
    """Delete every topic named `prefix` + "." + anything (what one `--topic-prefix` run made;
    benchmarks clean up after themselves so a long-lived broker does not pile up topics, whose
    metadata every client then reads); returns the names deleted."""
    admin = _admin(bootstrap_servers, timeout)
    await admin.start()
    try:
        names = sorted(t for t in await admin.list_topics() if t.startswith(prefix + "."))
        if names:
            await admin.delete_topics(names, timeout_ms=int(timeout * 1000))
    finally:
        await admin.close()
    return names


async def partitions_of(bootstrap_servers: str, topic: str) -> list[int]:
    """The partition numbers of an existing topic (as the broker's controller knows them: a topic
    made a moment ago counts, which a client's cached metadata may not show yet)."""
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap_servers, **kafka_client_options())
    await admin.start()
    try:
        (described,) = await admin.describe_topics([topic])
    finally:
        await admin.close()
    partitions = [p["partition"] for p in described["partitions"]]
    if described["error_code"] != 0 or not partitions:
        raise RuntimeError(f"topic {topic} has no partitions (does it exist?)")
    return sorted(partitions)
