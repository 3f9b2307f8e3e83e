"""The local development stack: one Kafka broker and one Redis, started without Docker."""

from __future__ import annotations

from dataclasses import dataclass

from sluice.connectors.kafka_broker import LocalKafka
from sluice.connectors.processes import StackError
from sluice.connectors.redis_server import LocalRedis
from sluice.connectors.settings import StackSettings

__all__ = ["LocalStack", "StackError", "StackStatus"]


@dataclass
class StackStatus:
    kafka_pid: int | None
    kafka_answers: bool
    redis_pid: int | None
    redis_answers: bool

    @property
    def healthy(self) -> bool:
        return self.kafka_answers and self.redis_answers


class LocalStack:
    def __init__(self, settings: StackSettings | None = None):
        self.settings = settings or StackSettings()
        self.kafka = LocalKafka(self.settings)
        self.redis = LocalRedis(self.settings)

    def up(self) -> dict[str, bool]:
        """Start what is not running. Returns which services this call started."""
        started_redis = self.redis.start()
        try:
            started_kafka = self.kafka.start()
        except BaseException:
            # Leave nothing of ours half-started behind a failed `up`.
            if started_redis:
                self.redis.stop()
            raise
        return {"kafka": started_kafka, "redis": started_redis}

    def down(self) -> dict[str, bool]:
        """Stop our processes. Returns which services this call stopped."""
        return {"kafka": self.kafka.stop(), "redis": self.redis.stop()}

    def status(self) -> StackStatus:
        kafka_pid = self.kafka.pid()
        redis_pid = self.redis.pid()
        return StackStatus(
            kafka_pid=kafka_pid,
            kafka_answers=self.kafka.answers(timeout=3) if kafka_pid else False,
            redis_pid=redis_pid,
            redis_answers=self.redis.answers() if redis_pid else False,
        )
