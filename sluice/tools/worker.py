"""A tool worker: it reads calls from ``PREFIX.tools.<name>`` for each tool of its `Toolbox`, runs
them, and publishes each answer to the call's reply topic (``sluice tools serve module:obj``).

Each call is answered once, whatever stops the worker: answers are kept in a compacted topic
(``PREFIX.tool-answers``, keyed by the call's idempotency key) before they are published, and a
call's offset is committed only after its answer is in Kafka, so a call read again (a restart, a
rebalance, a caller that published it twice) gets the answer already given instead of a second
run. A tool that is not idempotent is marked started there before it runs: found started and not
answered, the worker stopped while running it, and it is answered ``interrupted`` rather than run
a second time. Workers of one group share the calls by partition; more workers serve more calls.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import time
from functools import partial

from aiokafka import AIOKafkaConsumer, ConsumerRebalanceListener
from aiokafka.errors import KafkaError
from pydantic import ValidationError

from sluice.connectors.changelog import TOPIC_CONFIG, Changelog
from sluice.connectors.kafka_consumer import commit_or_skip
from sluice.connectors.kafka_producer import EventProducer
from sluice.connectors.kafka_security import kafka_client_options
from sluice.connectors.retriable import retrying
from sluice.connectors.topics import ensure_topics
from sluice.schemas.tool_messages import ToolCallMessage, ToolFailure, ToolResultMessage
from sluice.tools.registry import InvalidArguments, Toolbox, ToolError

log = logging.getLogger(__name__)

PARTITIONS = 4
MAX_RESULT_CHARS = 16_000  # of an answer: what a model can read, and a record stays small


def tool_topic(prefix: str, name: str) -> str:
    return f"{prefix}.tools.{name}"


def results_topic(prefix: str) -> str:
    return f"{prefix}.tool-results"


def answers_topic(prefix: str) -> str:
    return f"{prefix}.tool-answers"


class ToolWorker:
    def __init__(
        self,
        bootstrap_servers: str,
        prefix: str,
        toolbox: Toolbox,
        *,
        group: str | None = None,
        worker_id: str | None = None,
    ):
        self.bootstrap_servers = bootstrap_servers
        self.prefix = prefix
        self.toolbox = toolbox
        self.group = group or f"{prefix}.tool-workers"
        self.worker_id = worker_id or f"tools-{socket.gethostname()}-{os.getpid()}"
        self.served = 0  # calls answered by this process (a run or an answer given again)
        self._consumer: AIOKafkaConsumer | None = None
        self._producer: EventProducer | None = None
        self._answers: Changelog | None = None
        self.ready = asyncio.Event()
        self._reassigned = False  # partitions assigned since the answers were last read

    @property
    def topics(self) -> list[str]:
        return [tool_topic(self.prefix, name) for name in self.toolbox.tools]

    async def start(self) -> None:
        await ensure_topics(
            self.bootstrap_servers,
            {t: PARTITIONS for t in [*self.topics, results_topic(self.prefix)]},
        )
        await ensure_topics(
            self.bootstrap_servers, {answers_topic(self.prefix): PARTITIONS}, config=TOPIC_CONFIG
        )
        self._producer = EventProducer(
            bootstrap_servers=self.bootstrap_servers, client_id=self.worker_id
        )
        await self._producer.start()
        self._answers = Changelog(
            self.bootstrap_servers, answers_topic(self.prefix), self._producer
        )
        await self._answers.start()
        self._consumer = AIOKafkaConsumer(
            bootstrap_servers=self.bootstrap_servers,
            group_id=self.group,
            client_id=self.worker_id,
            enable_auto_commit=False,
            auto_offset_reset="earliest",
            isolation_level="read_committed",
            **kafka_client_options(),
        )
        await self._consumer.start()
        self._consumer.subscribe(self.topics, listener=_Reassigned(self))
        log.info(
            "serving %s from %s (group %s, %d answers kept)",
            ", ".join(self.toolbox.tools),
            ", ".join(self.topics),
            self.group,
            len(self._answers),
        )

    async def stop(self) -> None:
        for part in (self._consumer, self._answers, self._producer):
            if part is not None:
                await part.stop()

    async def run(self) -> None:
        """Serve calls until cancelled."""
        assert self._consumer is not None
        self.ready.set()
        while True:
            batch = await self._consumer.getmany(timeout_ms=500)
            for tp, records in batch.items():
                for record in records:
                    await self._serve(record.value)
                    # (skipped after a rebalance: the call's new owner answers it again from the
                    # answers topic, without running it)
                    await commit_or_skip(self._consumer, {tp: record.offset + 1})

    async def _serve(self, raw: bytes | None) -> None:
        assert self._answers is not None and self._producer is not None
        try:
            call = ToolCallMessage.model_validate_json(raw or b"")
        except ValidationError as e:
            log.error("not a tool call, skipped: %s", e.errors()[0]["msg"] if e.errors() else e)
            return
        if self._answers.get(call.key) is None and self._reassigned:
            # Calls of partitions another worker had may have been answered there: its answers
            # are read once after each rebalance (not for every new call: that costs a read to
            # the end of the answers topic, 0.1-0.6 s when the topic has been idle).
            await self._answers.catch_up()
            self._reassigned = False
        kept = self._answers.get(call.key)
        state = json.loads(kept) if kept is not None else None
        if state is not None and state.get("answer") is not None:
            log.info("call %s answered before: answering it again as it was", call.key)
            result = ToolResultMessage.model_validate(state["answer"])
        else:
            result = await self._answer(call, started_before=state is not None)
            await self._keep(call.key, {"answer": result.model_dump()})
        topic = call.reply_topic or results_topic(self.prefix)
        send = partial(
            self._producer.send_and_wait, topic, call.request_id, result.model_dump_json().encode()
        )
        try:
            if topic == results_topic(self.prefix):  # made by this worker: faults pass
                await retrying(send, f"answering call {call.key}")
            else:  # a caller's topic, which may not exist: one try
                await send()
        except KafkaError as e:  # (a reply topic that cannot take it: the call is lost to it)
            log.error("call %s: its answer could not be sent to %s: %s", call.key, topic, e)
            return
        self.served += 1

    async def _keep(self, key: str, state: dict) -> None:
        """A call's state in the answers topic, through Kafka's passing faults (a key written
        twice holds the same value)."""
        assert self._answers is not None
        answers, value = self._answers, {key: json.dumps(state).encode()}
        await retrying(lambda: answers.put(value), f"keeping call {key}")

    async def _answer(self, call: ToolCallMessage, started_before: bool) -> ToolResultMessage:
        assert self._answers is not None
        tool = self.toolbox.tools.get(call.name)

        def result(
            ok: bool, content: str, error: ToolFailure | None = None, seconds: float = 0.0
        ) -> ToolResultMessage:
            return ToolResultMessage(
                key=call.key,
                request_id=call.request_id,
                call_id=call.call_id,
                name=call.name,
                ok=ok,
                content=content,
                error=error,
                seconds=round(seconds, 3),
                worker=self.worker_id,
            )

        if tool is None:
            known = ", ".join(self.toolbox.tools)
            return result(False, f"no tool named {call.name!r} (known: {known})", "unknown_tool")
        if call.deadline is not None and call.deadline < time.time():
            return result(False, "the call's deadline had passed before it was run", "expired")
        if started_before and not tool.idempotent:
            log.warning("call %s was running when its worker stopped: not run again", call.key)
            return result(
                False,
                f"the worker stopped while running {call.name}; it may or may not have taken "
                "effect, and it is not run twice",
                "interrupted",
            )
        if not tool.idempotent:
            await self._keep(call.key, {"started": self.worker_id})
        started = time.monotonic()
        try:
            content = await asyncio.to_thread(tool, call.arguments)
        except InvalidArguments as e:
            return result(False, f"invalid arguments: {e}", "invalid_arguments")
        except ToolError as e:
            return result(False, str(e), "failed", time.monotonic() - started)
        except Exception as e:  # a bug in the tool: the model hears of it, the worker goes on
            log.exception("tool %s failed on call %s", call.name, call.key)
            return result(False, f"{type(e).__name__}: {e}", "failed", time.monotonic() - started)
        if len(content) > MAX_RESULT_CHARS:
            cut = len(content) - MAX_RESULT_CHARS
            content = content[:MAX_RESULT_CHARS] + f"\n[... {cut} more characters cut]"
        return result(True, content, None, time.monotonic() - started)


class _Reassigned(ConsumerRebalanceListener):
    def __init__(self, worker: ToolWorker):
        self.worker = worker

    async def on_partitions_revoked(self, revoked) -> None:
        pass

    async def on_partitions_assigned(self, assigned) -> None:
        self.worker._reassigned = True


async def serve(
    bootstrap_servers: str,
    prefix: str,
    toolbox: Toolbox,
    *,
    group: str | None = None,
    worker_id: str | None = None,
) -> None:
    worker = ToolWorker(bootstrap_servers, prefix, toolbox, group=group, worker_id=worker_id)
    await worker.start()
    try:
        await worker.run()
    finally:
        await worker.stop()
