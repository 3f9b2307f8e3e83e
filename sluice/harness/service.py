"""The harness service (``sluice agent serve``): it reads run requests from ``PREFIX.harness``, the
model turns' events from ``PREFIX.replies.harness``, tool results from ``PREFIX.tool-results``
and decisions on calls that need approval from ``PREFIX.harness-approvals``,
moves each run on (`run.py`), and publishes what that says: model turns to ``PREFIX.requests``,
tool calls to ``PREFIX.tools.<name>``, the run's events to ``PREFIX.harness-events``.

Crash-safe by order: for each input it publishes first (and waits until Kafka has it all), then
keeps the run's state in the compacted ``PREFIX.harness-state``, then commits the input. Stopped
anywhere, it starts from the states it kept and reads the uncommitted inputs again; a transition
made twice publishes the same names (`run.py`), which their readers take once, so every model turn
is served once, every tool call is answered once (a tool that is not idempotent is never run
twice) and every run ends with one final.

One service serves every run (it reads all partitions); a second one would share no state with it.
A run that ended is kept (a repeat of its request gets its final again) for ``keep_ended_s``, then
forgotten: its state is deleted from the topic and from memory.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.errors import KafkaError
from pydantic import BaseModel, ValidationError

from sluice.connectors.changelog import TOPIC_CONFIG, Changelog
from sluice.connectors.kafka_consumer import commit_or_skip
from sluice.connectors.kafka_producer import EventProducer
from sluice.connectors.kafka_security import kafka_client_options
from sluice.connectors.retriable import retrying
from sluice.connectors.sessions import SessionStore, redact
from sluice.connectors.topics import ensure_topics, partitions_of
from sluice.harness.run import Outbox, Run, RunState, Topics
from sluice.harness.verify import Vote, VoteState
from sluice.schemas import decode_event
from sluice.schemas.events import ErrorEvent, FinalEvent, TokenEvent
from sluice.schemas.harness import Approval, HarnessFinal, HarnessRequest
from sluice.schemas.parse import error_from_validation
from sluice.schemas.tool_messages import ToolResultMessage

log = logging.getLogger(__name__)

PARTITIONS = 4
KEEP_ENDED_S = 3600.0  # an ended run is kept this long (a repeat of it gets its final again)


def harness_topics(prefix: str) -> dict[str, str]:
    return {
        "requests": f"{prefix}.harness",
        "events": f"{prefix}.harness-events",
        "replies": f"{prefix}.replies.harness",
        "tool_results": f"{prefix}.tool-results",
        "approvals": f"{prefix}.harness-approvals",
        "state": f"{prefix}.harness-state",
    }


class HarnessService:
    def __init__(
        self,
        bootstrap_servers: str,
        prefix: str,
        redis_url: str | None = None,
        keep_ended_s: float = KEEP_ENDED_S,
    ):
        self.bootstrap_servers = bootstrap_servers
        self.prefix = prefix
        # An ended run is forgotten (its state deleted) this long after it ended: a request
        # with its id after that is a new run. Like a dedup window, long enough for any retry.
        self.keep_ended_s = keep_ended_s
        self._next_sweep = 0.0
        # runs with a session_id continue its conversation and add themselves to it (none
        # without Redis: they run on their own messages)
        self.sessions = SessionStore(redis_url) if redis_url else None
        self.names = harness_topics(prefix)
        self.topics = Topics(
            requests=f"{prefix}.requests",
            replies=self.names["replies"],
            events=self.names["events"],
            tool_results=self.names["tool_results"],
            tool_prefix=f"{prefix}.tools",
        )
        self.runs: dict[str, Run] = {}
        # runs with a verifier (`verify.py`); their samples are in `runs`
        self.votes: dict[str, Vote] = {}
        self._producer: EventProducer | None = None
        self._states: Changelog | None = None
        self._consumer: AIOKafkaConsumer | None = None

    async def start(self) -> None:
        n = self.names
        await ensure_topics(
            self.bootstrap_servers,
            {
                t: PARTITIONS
                for t in (n["requests"], n["events"], n["replies"], n["tool_results"])
                + (n["approvals"], self.topics.requests)
            },
        )
        await ensure_topics(self.bootstrap_servers, {n["state"]: PARTITIONS}, config=TOPIC_CONFIG)
        self._producer = EventProducer(
            bootstrap_servers=self.bootstrap_servers, client_id="harness"
        )
        await self._producer.start()
        self._states = Changelog(self.bootstrap_servers, n["state"], self._producer)
        await self._states.start()
        for run_id in self._states.keys():
            raw = self._states.get(run_id)
            if raw is None:
                continue
            kept = json.loads(raw)
            if "samples" in kept:  # (a verifier's run)
                self.votes[run_id] = Vote(VoteState.model_validate(kept), self.topics)
            else:
                self.runs[run_id] = Run(RunState.model_validate(kept), self.topics)
        self._consumer = AIOKafkaConsumer(
            bootstrap_servers=self.bootstrap_servers,
            group_id=f"{self.prefix}.harness",
            client_id="harness",
            enable_auto_commit=False,
            auto_offset_reset="earliest",
            isolation_level="read_committed",
            **kafka_client_options(),
        )
        await self._consumer.start()
        inputs = (n["requests"], n["replies"], n["tool_results"], n["approvals"])
        partitions = [
            TopicPartition(topic, p)
            for topic in inputs
            for p in await partitions_of(self.bootstrap_servers, topic)
        ]
        self._consumer.assign(partitions)
        await self._gather_samples()
        unfinished = sum(not r.done for r in self.runs.values())
        if self.sessions is not None:
            await self.sessions.verify_credentials()  # a wrong password is an error, at once
        log.info(
            "harness serving runs from %s (%d kept, %d unfinished), sessions %s",
            n["requests"],
            len(self.runs),
            unfinished,
            f"in Redis at {redact(self.sessions.url)}" if self.sessions else "off",
        )

    async def _gather_samples(self) -> None:
        """Samples that ended while their verifier's state was not kept yet (a stop in between)
        are told to it now (it takes each once)."""
        for vote in self.votes.values():
            for sample in vote.state.samples:
                run = self.runs.get(sample)
                if not vote.done and run is not None and run.done:
                    await self._apply(vote, vote.on_sample_final(run.final_event(), time.time()))

    async def stop(self) -> None:
        for part in (self._consumer, self._states, self._producer):
            if part is not None:
                await part.stop()
        if self.sessions is not None:
            await self.sessions.close()

    async def run(self) -> None:
        assert self._consumer is not None
        while True:
            batch = await self._consumer.getmany(timeout_ms=500)
            for tp, records in batch.items():
                for record in records:
                    await self._handle(tp.topic, record.value)
                    # (skipped, it is read again later: a move made again is taken once)
                    await commit_or_skip(self._consumer, {tp: record.offset + 1})
            await self._clock()

    async def _clock(self) -> None:
        now = time.time()
        machines: list[Run | Vote] = [*self.runs.values(), *self.votes.values()]
        for machine in machines:
            if not machine.done:
                await self._apply(machine, machine.on_clock(now))
        if now >= self._next_sweep:
            self._next_sweep = now + min(60.0, self.keep_ended_s)
            await self._forget_ended(now)

    async def _forget_ended(self, now: float) -> None:
        """Drop the runs that ended more than `keep_ended_s` ago, from memory and from the state
        topic (a tombstone). A verifier's sample goes after its verifier's run."""
        assert self._states is not None
        machines: list[Run | Vote] = [*self.runs.values(), *self.votes.values()]
        old = [m for m in machines if m.done and now - m.state.ended_at > self.keep_ended_s]
        forgotten = [
            m.run_id for m in old if not (isinstance(m, Run) and m.state.sample_of in self.votes)
        ]
        if not forgotten:
            return
        await self._states.delete(*forgotten)
        for run_id in forgotten:
            self.runs.pop(run_id, None)
            self.votes.pop(run_id, None)
        log.info(
            "forgot %d runs ended more than %.0f s ago (%d kept)",
            len(forgotten),
            self.keep_ended_s,
            len(self.runs) + len(self.votes),
        )

    async def _handle(self, topic: str, raw: bytes | None) -> None:
        now = time.time()
        if topic == self.names["requests"]:
            await self._requested(raw, now)
            return
        run, move = self._addressee(topic, raw)
        if run is None or move is None:
            return  # (not for a run of this service, or not a message at all)
        try:
            out = move(now)
        except Exception as e:  # a fault moving one run on ends that run, not the service
            log.exception("run %s: moving it on failed", run.run_id)
            out = run.fail(f"the harness failed: {type(e).__name__}: {e}", now)
        await self._apply(run, out)

    async def _requested(self, raw: bytes | None, now: float) -> None:
        try:
            request = HarnessRequest.model_validate_json(raw or b"")
        except ValidationError as e:
            await self._refuse(raw, e, now)
            return
        known = self.runs.get(request.run_id) or self.votes.get(request.run_id)
        if known is not None:
            log.info("run %s asked for again: it is under way or done", request.run_id)
            if known.done:  # its asker may have missed the answer: it is sent again, as it was
                await self._publish([(self.topics.events, known.run_id, known.final_event())])
            return
        history = await self._history(request)
        if request.verifier is not None and request.verifier.samples:
            vote, samples, out = Vote.start(request, self.topics, now, history=history)
            self.votes[vote.run_id] = vote
            self.runs |= {sample.run_id: sample for sample in samples}
            log.info(
                "run %s: started (%s of %d samples)",
                vote.run_id,
                request.verifier.type,
                len(samples),
            )
            try:  # (then the states: stopped in between, it starts them again, as they were)
                await self._publish(out.records)
            except KafkaError as e:
                log.error("run %s: could not start its samples (%s): it ends", vote.run_id, e)
                await self._publish(vote.fail(f"could not publish: {e}", now).records)
            for sample in samples:
                await self._keep(sample)
            await self._keep(vote)
            return
        run, out = Run.start(request, self.topics, now, history=history)
        self.runs[request.run_id] = run
        log.info("run %s: started", request.run_id)
        await self._apply(run, out)

    async def _history(self, request: HarnessRequest) -> list[dict[str, Any]]:
        """The conversation of the run's session before the run (none without a session)."""
        if request.session_id is None:
            return []
        if self.sessions is None:
            log.warning(
                "run %s: no sessions here (no Redis): its session is not read", request.run_id
            )
            return []
        found = await self.sessions.history_for(request.tenant, request.session_id, request.run_id)
        return list(found[0]) if found else []

    async def _remember(self, machine: Run | Vote) -> None:
        """Add an answered run to its session (made again, it replaces its own entry)."""
        conversation = machine.remembered()
        if conversation is None or self.sessions is None:
            return
        r = machine.state.request
        assert r.session_id is not None
        start = (len(machine.state.history), 0)
        # (no token ids: the next turn renders the conversation afresh, its KV found by prefix)
        if not await self.sessions.record_turn(
            r.tenant, r.session_id, r.run_id, conversation, [], start
        ):
            log.warning("run %s: its session %s was not updated (Redis)", r.run_id, r.session_id)

    async def _refuse(self, raw: bytes | None, error: ValidationError, now: float) -> None:
        """A request that is not a valid run: its asker hears why, if it can be told apart."""
        refused = error_from_validation(error, None, HarnessRequest)
        why = f"{refused.code}: {refused.message}"
        try:
            run_id = json.loads(raw or b"").get("run_id")
        except (ValueError, AttributeError):
            run_id = None
        if not isinstance(run_id, str) or not run_id or run_id in self.runs or run_id in self.votes:
            log.error("not a harness request, skipped: %s", why)
            return
        final = HarnessFinal(
            run_id=run_id,
            seq=0,
            answer="",
            stop_reason="error",
            steps=0,
            tool_calls=0,
            completion_tokens=0,
            prompt_tokens=0,
            seconds=0.0,
            error=why,
        )
        await self._publish([(self.topics.events, run_id, final)])

    def _addressee(self, topic: str, raw: bytes | None) -> tuple[Run | Vote | None, Any]:
        """The run a message is for, and the move it makes."""
        if topic == self.names["replies"]:
            try:
                event = decode_event(raw or b"")
            except Exception:
                return None, None
            if event.request_id is None:
                return None, None
            run = self.runs.get(event.request_id.rpartition(".m")[0])
            if run is None:
                return None, None
            if isinstance(event, TokenEvent):
                return run, lambda now: run.on_token_event(event)
            if not isinstance(event, (FinalEvent, ErrorEvent)):
                return None, None
            return run, lambda now: run.on_model_event(event, now)
        if topic == self.names["approvals"]:
            try:
                approval = Approval.model_validate_json(raw or b"")
            except ValidationError as e:
                log.error("not an approval, skipped: %s", e.errors()[0].get("msg"))
                return None, None
            approved = self.runs.get(approval.run_id)
            if approved is None:
                return None, None
            return approved, lambda now: approved.on_approval(approval, now)
        try:
            result = ToolResultMessage.model_validate_json(raw or b"")
        except ValidationError:
            return None, None
        found: Run | Vote | None = self.runs.get(result.request_id)
        found = found or self.votes.get(result.request_id)
        if found is None:
            return None, None
        return found, lambda now: found.on_tool_result(result, now)

    async def _apply(self, machine: Run | Vote, out: Outbox) -> None:
        """Publish what a transition says, then keep the run's state; a sample that ended is
        then told to its verifier's run."""
        if not out.records:
            return
        changed = out.changed
        try:
            await self._publish(out.records)
        except KafkaError as e:  # e.g. a message over the broker's size limit
            log.error("run %s: could not publish its move (%s): it ends", machine.run_id, e)
            if isinstance(machine, Run):
                machine.state.trace = []  # (the final, at least, is small)
            await self._publish(machine.fail(f"could not publish: {e}", time.time()).records)
            changed = True
        if not changed:  # (a delta passed on: nothing to keep)
            return
        if machine.done:
            await self._remember(machine)
        await self._keep(machine)
        if not machine.done:
            return
        log.info("run %s: ended (%s)", machine.run_id, machine.state.stop_reason)
        vote = self.votes.get(machine.state.sample_of or "") if isinstance(machine, Run) else None
        if vote is not None and isinstance(machine, Run):
            await self._apply(vote, vote.on_sample_final(machine.final_event(), time.time()))

    async def _keep(self, machine: Run | Vote) -> None:
        assert self._states is not None
        states, kept = self._states, {machine.run_id: machine.state.model_dump_json().encode()}
        await retrying(lambda: states.put(kept), "keeping a run's state")

    async def _publish(self, records: list[tuple[str, str, BaseModel | dict[str, Any]]]) -> None:
        """Send, and return once Kafka has every record. A retriable error (a partition's leader
        moving, a broker restarting) is waited out: records sent again are taken once by their
        names; one that is not (a record over the size limit) is raised."""
        assert self._producer is not None
        producer = self._producer
        values = [
            (topic, key, m.model_dump_json() if isinstance(m, BaseModel) else _dumps(m))
            for topic, key, m in records
        ]

        async def send_all() -> None:
            delivered = [
                await producer.send(topic, key=key, value=value.encode())
                for topic, key, value in values
            ]
            await asyncio.gather(*delivered)

        await retrying(send_all, "publishing")


def _dumps(message: dict) -> str:
    return json.dumps(message, ensure_ascii=False, separators=(",", ":"))


async def serve(
    bootstrap_servers: str,
    prefix: str,
    redis_url: str | None = None,
    keep_ended_s: float = KEEP_ENDED_S,
) -> None:
    service = HarnessService(bootstrap_servers, prefix, redis_url, keep_ended_s)
    await service.start()
    try:
        await service.run()
    finally:
        await service.stop()
