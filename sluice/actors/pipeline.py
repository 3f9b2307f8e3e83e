"""Wiring: the four actors in one process (`sluice run`), or one role per process connected by
internal topics (`sluice run --role ...`), scaled by consumer groups.

    all in one:  requests ─► tokenizer ─► scheduler ─► runner ─► streamer ─► tokens
    per role:    requests ─► tokenizer ─► internal.tokenized ─► scheduler ─► internal.work
                 ─► runner(s) ─► internal.steps ─► streamer ─► tokens

Shutdown (SIGTERM, SIGINT): stop reading, let in-flight requests finish (bounded by
`drain_timeout_s`), commit what finished, then stop the actors. What did not finish is read again
by whoever owns the partition next.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import signal
import socket
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from functools import partial
from typing import TYPE_CHECKING, Any

from aiokafka.errors import InvalidSessionTimeoutError

from sluice.actors.answered import AnsweredInputs
from sluice.actors.failover import RunnerFailover
from sluice.actors.health import OpsServer
from sluice.actors.ingress import Ingress
from sluice.actors.kv_events import SNAPSHOT_EVERY_S, KvEventPublisher, KvEventsMessage
from sluice.actors.kv_handoff import KvFiles, KvFileServer, PrefillHandoff, default_transfer_dir
from sluice.actors.kv_router import DEAD_AFTER_S, LOAD_MARGIN, ROUTINGS, KvRouter
from sluice.actors.messages import StepMessage, TokenizedRequest
from sluice.actors.metrics import Metrics
from sluice.actors.progress import ProgressLog
from sluice.actors.reply_topics import ReplyTopics
from sluice.actors.roles import (
    DECODE,
    PREFILL,
    ROLES,
    RUNNER,
    SCHEDULER,
    STREAMER,
    TOKENIZER,
    Role,
    role_named,
)
from sluice.actors.runner_actor import RunnerActor
from sluice.actors.runtime import ActorFailed, ActorSystem, in_passing_thread
from sluice.actors.scheduler_actor import SchedulerActor, routing_key
from sluice.actors.streamer_actor import StreamerActor
from sluice.actors.tokenizer_actor import TokenizerActor
from sluice.actors.transport import KafkaSink
from sluice.connectors.changelog import TOPIC_CONFIG as CHANGELOG_CONFIG
from sluice.connectors.changelog import Changelog
from sluice.connectors.kafka_consumer import MembershipLost, RequestConsumer
from sluice.connectors.kafka_producer import EventProducer
from sluice.connectors.kafka_security import (
    KafkaRefused,
    KafkaSecurity,
    KafkaSecurityError,
    check_access,
)
from sluice.connectors.sessions import RedisRefused, SessionStore
from sluice.connectors.settings import kafka_bootstrap_servers, redis_url
from sluice.connectors.topic_tail import TopicTail
from sluice.connectors.topics import ensure_topics
from sluice.connectors.transactions import PartitionTransactions
from sluice.engine import EngineConfig, reasoning_formats, tool_formats

if TYPE_CHECKING:
    from sluice.engine import LLMEngine
    from sluice.engine.tokenizer import Tokenizer

log = logging.getLogger(__name__)

AT_LEAST_ONCE, EXACTLY_ONCE = "at-least-once", "exactly-once"
MAX_REQUEST_BYTES = 4 << 20  # the largest request the requests topic takes
DELIVERIES = (AT_LEAST_ONCE, EXACTLY_ONCE)
KV_EVENTS_CATCH_UP_S = 15.0
KV_EVENTS_CONFIG = {"retention.ms": str(3_600_000)}  # schedulers read back 2 snapshot intervals
TOPIC_NAME = re.compile(r"[A-Za-z0-9._-]{1,200}")
METADATA_REFRESH_MS = 10_000  # how soon the consumer sees a new topic of its pattern
BROKER_PROBE_S = 5.0  # how often /readyz's broker check asks the broker for metadata
BROKER_FRESH_S = 3 * BROKER_PROBE_S  # not ready once the broker has not answered for this long


@dataclass
class Topics:
    requests: str = "sluice.requests"
    tokens: str = "sluice.tokens"
    dlq: str = "sluice.dlq"
    tokenized: str = "sluice.internal.tokenized"
    work: str = "sluice.internal.work"
    steps: str = "sluice.internal.steps"
    progress: str = "sluice.progress"  # compacted: what each request in flight has published
    kv_events: str = "sluice.kv-events"  # runners' cached blocks and load, for routing
    replies: str = "sluice.replies.*"  # the pattern a request's reply_topic must match

    def reserved(self) -> set[str]:
        """The pipeline's own topics: never a reply topic."""
        return {
            self.requests,
            self.dlq,
            self.progress,
            self.tokenized,
            self.work,
            self.steps,
            self.kv_events,
        }

    def runner_work(self, runner_id: str) -> str:
        """The work topic of one runner, when requests are routed to runners (`--routing kv`)."""
        return f"{self.work}.{runner_id}"


@dataclass
class PipelineConfig:
    model: str | None = None
    engine: EngineConfig = field(default_factory=EngineConfig)
    bootstrap_servers: str = field(default_factory=kafka_bootstrap_servers)
    redis_url: str | None = field(default_factory=redis_url)  # None: no sessions
    topics: Topics = field(default_factory=Topics)
    partitions: int = 4
    group: str = "sluice"
    max_in_flight: int = 64  # unfinished requests per process before its input pauses
    # Kafka's static membership (group.instance.id): a process restarted under the same id
    # takes its partitions back at once instead of after the dead member's session timeout.
    group_instance_id: str | None = None
    session_timeout_ms: int = 10_000  # a silent member is dropped from the group after this
    session_ttl_s: int = 3600
    redis_outage_wait_s: float = 30.0  # how long session turns wait for Redis to come back
    metrics_port: int | None = None
    runner_id: str = field(default_factory=lambda: f"runner-{socket.gethostname()}-{os.getpid()}")
    drain_timeout_s: float = 60.0
    create_reply_topics: bool = False  # create a missing reply topic (else: an error event)
    delivery: str = "at-least-once"  # or "exactly-once" (docs/DELIVERY.md)
    commit_interval_ms: int | None = None  # default: 100 exactly-once, 1000 at-least-once
    # A request being served this many times in a row when the process stopped, without getting
    # further, is dead-lettered instead of taken up again.
    max_crashes: int = 5
    # The events of requests that do not name a format: "sluice" or "openai" (requests in an
    # OpenAI shape name openai themselves, unless they say otherwise).
    event_format: str = "sluice"
    # How the model writes tool calls (`engine/tool_formats.py`); None: from its chat template.
    tool_call_parser: str | None = None
    # How a reasoning model's thinking is told from its answer (`engine/reasoning_formats.py`);
    # None: its text is all content.
    reasoning_parser: str | None = None
    # Also read PREFIX.requests.<tenant>, whose name decides the request's tenant (so Kafka ACLs
    # decide who may act as which tenant).
    tenant_topics: bool = False
    # How the scheduler picks a runner, with one role per process: "session" (the shared work
    # topic keyed by session), "kv" (the runner caching the longest prefix, by KV events) or
    # "round-robin" (by turns; both of these give each runner a work topic of its own).
    routing: str = "session"
    load_margin: int = LOAD_MARGIN  # kv routing: most requests over the least loaded runner
    runner_dead_after_s: float = DEAD_AFTER_S  # a runner silent this long is not routed to
    # Where a prefill runner leaves a prompt's KV for its decode runner (both must see it).
    kv_transfer_dir: str = field(default_factory=default_transfer_dir)
    # A prefill runner's: where it serves its KV files to decode runners on other hosts.
    kv_transfer_address: str | None = None

    @property
    def routed(self) -> bool:
        return self.routing != "session"


def tenant_topics_pattern(requests_topic: str) -> str:
    """The requests topic and its per-tenant topics (REQUESTS.<tenant>)."""
    return "^" + re.escape(requests_topic) + r"(\.[A-Za-z0-9_-]+)?$"


def tenant_of_topic(requests_topic: str, topic: str) -> str | None:
    """The tenant a per-tenant requests topic belongs to (None for the shared one)."""
    prefix = requests_topic + "."
    return topic[len(prefix) :] if topic.startswith(prefix) else None


class Pipeline:
    """One process's share of the pipeline: its actors, its consumer and its producer."""

    def __init__(self, config: PipelineConfig, role: str | None = None):
        self.config = config
        self.role = role_named(role)
        self.metrics = Metrics()
        self.system = ActorSystem(f"sluice-{self.role}", drain_timeout=config.drain_timeout_s)
        self.producer: EventProducer | None = None
        # Where the actors write: the producer, or (exactly-once) one transaction per partition.
        self.output: EventProducer | PartitionTransactions | None = None
        self.consumer: RequestConsumer | None = None
        self.sessions: SessionStore | None = None
        self.ingress: Ingress | None = None
        self.engine: LLMEngine | None = None
        self.progress: ProgressLog | None = None
        self.answered: AnsweredInputs | None = None
        self.reply_topics: ReplyTopics | None = None
        self._sinks: list[KafkaSink] = []
        self._stop = asyncio.Event()
        self.ops: OpsServer | None = None
        self._broker_answered_at: float | None = None  # monotonic
        self._broker_watch: asyncio.Task | None = None
        self.router: KvRouter | None = None  # the scheduler's, when routing to runners
        self._kv_feed: asyncio.Task | None = None
        self._failover: asyncio.Task | None = None
        self.kv_events: KvEventPublisher | None = None  # a routed runner's
        self.kv_server: KvFileServer | None = None  # a prefill runner's, for other hosts
        self.group = ""  # the consumer group this process reads its input in

    # -- assembly ------------------------------------------------------------------------------

    async def start(self) -> None:
        c, t = self.config, self.config.topics
        if c.delivery not in DELIVERIES:
            raise ValueError(f"delivery must be one of {', '.join(DELIVERIES)}, not {c.delivery!r}")
        exactly_once = c.delivery == EXACTLY_ONCE
        if exactly_once and self.role.alone:
            raise ValueError(
                "--delivery exactly-once runs all roles in one process for now (not with --role)"
            )
        if c.routing not in ROUTINGS:
            raise ValueError(f"routing must be one of {', '.join(ROUTINGS)}, not {c.routing!r}")
        if self.role.needs_routing and not c.routed:
            raise ValueError(
                f"--role {self.role} needs --routing kv or round-robin (runners of their own "
                "topics, the scheduler choosing among them), given to the scheduler too"
            )
        if c.routed and self.role.is_runner and not TOPIC_NAME.fullmatch(c.runner_id):
            raise ValueError(
                f"--runner-id {c.runner_id!r}: with --routing {c.routing} it names the runner's "
                "work topic, so it takes letters, digits, '.', '_' and '-' only"
            )
        security = KafkaSecurity.from_env()
        log.info("kafka at %s: %s", c.bootstrap_servers, security.describe())
        await check_access(c.bootstrap_servers, security)
        # Requests up to MAX_REQUEST_BYTES: a long prompt gets its prompt_too_long error, not a
        # refusal by the broker that the client would have to make sense of.
        await ensure_topics(
            c.bootstrap_servers,
            {t.requests: c.partitions},
            config={"max.message.bytes": str(MAX_REQUEST_BYTES)},
        )
        await ensure_topics(
            c.bootstrap_servers,
            {
                t.tokens: c.partitions,
                t.dlq: 1,
                **(
                    {t.tokenized: c.partitions, t.work: c.partitions, t.steps: c.partitions}
                    if self.role.alone
                    else {}
                ),
            },
        )
        if self.role.holds_engine:
            await ensure_topics(
                c.bootstrap_servers, {t.progress: c.partitions}, config=CHANGELOG_CONFIG
            )
        if c.routed and (self.role.routes or self.role.is_runner):
            await ensure_topics(
                c.bootstrap_servers, {t.kv_events: c.partitions}, config=KV_EVENTS_CONFIG
            )
        if c.routed and self.role.is_runner:
            await ensure_topics(c.bootstrap_servers, {t.runner_work(c.runner_id): c.partitions})
        if c.metrics_port is not None:
            self.ops = OpsServer(self.metrics.registry, self.readiness, self.alive)
            port = self.ops.start(c.metrics_port)
            log.info("metrics on :%d/metrics, probes on /healthz and /readyz", port)
        self.producer = EventProducer(
            bootstrap_servers=c.bootstrap_servers, client_id=f"sluice-{self.role}"
        )
        await self.producer.start()
        self._broker_answered_at = time.monotonic()
        self._broker_watch = asyncio.ensure_future(self._watch_broker())
        group = f"{c.group}-{self.role}" if self.role.alone else c.group
        if c.routed and self.role.is_runner:
            group = f"{group}-{c.runner_id}"  # its own topic: nobody else's joins disturb it
        self.group = group
        self.output = self.producer
        if exactly_once:
            self.output = PartitionTransactions(c.bootstrap_servers, app_id=c.group, group_id=group)
        if c.redis_url and self.role.keeps_sessions:
            self.sessions = SessionStore(
                c.redis_url, ttl_s=c.session_ttl_s, outage_wait_s=c.redis_outage_wait_s
            )
            await self.sessions.verify_credentials()  # a wrong password is an error, at once
            ok = await self.sessions.check()
            self.metrics.redis_available.set(1 if ok else 0)
            log.info(
                "sessions in Redis at %s: %s",
                c.redis_url,
                "available" if ok else "UNREACHABLE: serving without prefix reuse across turns",
            )
        if self.role.holds_engine:
            # What the requests in flight had published, before any of them is read again.
            self.progress = ProgressLog(Changelog(c.bootstrap_servers, t.progress, self.output))
            await self.progress.start()
            if exactly_once:
                # Requests answered by an error event alone are marked (in the progress topic):
                # at least once an answer sent twice is allowed, and dropped by consumers.
                self.answered = AnsweredInputs(self.progress.changelog)
                self.answered.reindex()
        if self.role.finds_reply_topics:
            self.reply_topics = ReplyTopics(
                c.bootstrap_servers,
                t.replies,
                t.reserved(),
                create=c.create_reply_topics,
                partitions=c.partitions,
            )
        # the role's actors: (the first, the topic it reads, how it decodes that topic's records)
        builders: dict[Role, Callable[[], Awaitable[Any]]] = {
            TOKENIZER: self._build_tokenizer,
            SCHEDULER: self._build_scheduler,
            RUNNER: partial(self._runner, "unified"),
            PREFILL: partial(self._runner, "prefill"),
            DECODE: partial(self._runner, "decode"),
            STREAMER: self._build_streamer,
        }
        first, topic, decode = await builders.get(self.role, self._build_all)()
        transactions = self.output if isinstance(self.output, PartitionTransactions) else None
        per_tenant = c.tenant_topics and topic == t.requests
        self.consumer = RequestConsumer(
            [topic],
            # with per-tenant topics: PREFIX.requests and every PREFIX.requests.<tenant>, those
            # made later found within METADATA_REFRESH_MS
            pattern=tenant_topics_pattern(t.requests) if per_tenant else None,
            metadata_max_age_ms=METADATA_REFRESH_MS,
            group_id=group,
            group_instance_id=c.group_instance_id,
            session_timeout_ms=c.session_timeout_ms,
            bootstrap_servers=c.bootstrap_servers,
            max_in_flight=c.max_in_flight,
            drain_timeout=c.drain_timeout_s,
            on_assigned=self._on_assigned,
            on_revoked=self._on_revoked if transactions else None,
            commit_with=transactions.commit if transactions else None,
            max_partition_fetch_bytes=MAX_REQUEST_BYTES + (64 << 10),
        )
        await self.consumer.start()
        interval = c.commit_interval_ms
        if interval is None:
            interval = 100 if exactly_once else 1000  # Kafka Streams' exactly-once default
        self.ingress = Ingress(
            self.consumer,
            self.output,
            first.tell,
            tokens_topic=t.tokens,
            dlq_topic=t.dlq,
            metrics=self.metrics,
            on_committed=self.progress.forget if self.progress else None,
            reply_topics=self.reply_topics,
            commit_interval_s=interval / 1000,
            answered=self.answered,
            event_format=c.event_format,
            tenant_of=partial(tenant_of_topic, t.requests) if per_tenant else None,
            **({"decode": decode} if decode else {}),
        )
        await self.system.start()
        log.info(
            "pipeline %s up: reading %s as group %s, max_in_flight %d, tokens to %s, "
            "dead letters to %s, delivery %s, commit every %d ms",
            self.role if self.role.alone else "all roles",
            topic,
            group,
            c.max_in_flight,
            t.tokens,
            t.dlq,
            c.delivery,
            interval,
        )

    # -- probes --------------------------------------------------------------------------------

    def readiness(self) -> dict[str, bool]:
        """What /readyz checks: each must hold for the process to take requests."""
        answered = self._broker_answered_at
        return {
            "model_loaded": not self.role.holds_engine or self.engine is not None,
            "consumer_assigned": self.consumer is not None and bool(self.consumer.assignment()),
            "broker_reachable": answered is not None
            and time.monotonic() - answered < BROKER_FRESH_S,
            "serving": not self._stop.is_set() and not self.system_failed(),
        }

    def alive(self) -> bool:
        """What /healthz checks: no actor has failed."""
        return not self.system_failed()

    async def _watch_broker(self) -> None:
        while True:
            await asyncio.sleep(BROKER_PROBE_S)
            if self.producer is not None and await self.producer.reachable(BROKER_PROBE_S):
                self._broker_answered_at = time.monotonic()

    async def _on_assigned(self, tps) -> None:
        """Before a new assignment's records are read: fence their earlier owners' transactions
        (exactly-once), then read what they had recorded of their requests."""
        if isinstance(self.output, PartitionTransactions):
            await self.output.assign(tps)
        if self.progress is not None:
            await self.progress.catch_up()
        if self.answered is not None:  # (in the progress topic, just read)
            self.answered.reindex()

    async def _on_revoked(self, tps) -> None:
        if isinstance(self.output, PartitionTransactions):
            await self.output.revoke(tps, {})

    async def _engine(self) -> LLMEngine:
        from sluice.engine import LLMEngine
        from sluice.engine.cpus import bind_this_thread
        from sluice.engine.faults import fault_hook_from_env

        # Loading takes seconds: keep the loop free meanwhile (in a thread that then ends: see
        # in_passing_thread for why not asyncio.to_thread).
        self.engine = engine = await in_passing_thread(
            LLMEngine, self.config.model, self.config.engine
        )
        engine.fault_hook = fault_hook_from_env(engine.tokenizer)  # tests only
        self._choose_formats(engine.tokenizer, engine)
        if engine.other_cpus:
            # The engine has CPUs of its own: this loop (and the threads it starts) keeps off them
            bind_this_thread(engine.other_cpus)
        return engine

    def _choose_formats(self, tokenizer: Tokenizer | None, engine: LLMEngine | None = None) -> None:
        """The tokenizer's tool-call and reasoning formats (and the engine's provenance, which
        names them)."""
        if tokenizer is None:
            return
        reasoning = self.config.reasoning_parser
        if reasoning is not None:
            tokenizer.reasoning_format = reasoning_formats.named(reasoning)
            if engine is not None:
                engine.provenance = replace(engine.provenance, reasoning_format=reasoning)
            log.info("reasoning read in the %s format (--reasoning-parser)", reasoning)
        name = self.config.tool_call_parser
        if name is not None:
            tokenizer.tool_format = tool_formats.named(name)(tokenizer)
            if engine is not None:
                engine.provenance = replace(
                    engine.provenance, tool_format=tokenizer.tool_format.name
                )
        how = "--tool-call-parser" if name else "chosen from the model's chat template"
        if not tool_formats.template_renders_tools(tokenizer.chat_template):
            how += (
                "; the template does not render tools: sluice describes them in the system message"
            )
        log.info("tool calls read in the %s format (%s)", tokenizer.tool_format.name, how)

    def _sink(self, topic: str, key) -> KafkaSink:
        assert self.producer is not None  # start() made it before building the actors
        sink = KafkaSink(self.producer, topic, key)
        self._sinks.append(sink)
        return sink

    def _streamer(self) -> StreamerActor:
        assert self.output is not None  # start() made it before building the actors
        return StreamerActor(
            self.output,
            self.config.topics.tokens,
            self.sessions,
            metrics=self.metrics,
            dlq_topic=self.config.topics.dlq,
            answered=self.answered,
            event_format=self.config.event_format,
            capacity=max(1024, 4 * self.config.max_in_flight),
        )

    async def _build_all(self):
        c = self.config
        engine = await self._engine()
        streamer = self._streamer()
        runner = RunnerActor(
            engine,
            streamer.tell,
            runner_id=c.runner_id,
            max_queue=c.max_in_flight,
            metrics=self.metrics,
            progress=self.progress,
            max_crashes=c.max_crashes,
        )
        scheduler = SchedulerActor([runner.tell], streamer.tell, capacity=c.max_in_flight)
        tokenizer = TokenizerActor(
            engine.tokenizer,
            engine.max_model_len,
            self.sessions,
            scheduler.tell,
            streamer.tell,
            reply_topics=self.reply_topics,
            capacity=c.max_in_flight,
        )
        self.system.add(tokenizer, sends_to=[scheduler, streamer])
        self.system.add(scheduler, sends_to=[runner, streamer])
        self.system.add(runner, sends_to=[streamer])
        self.system.add(streamer)
        self.runner = runner
        return tokenizer, c.topics.requests, None

    async def _build_tokenizer(self):
        from sluice.engine.loader import load_tokenizer

        c, t = self.config, self.config.topics
        tokenizer, model_config = await asyncio.to_thread(load_tokenizer, c.model)
        self._choose_formats(tokenizer)
        max_len = c.engine.max_model_len or model_config.max_position_embeddings
        actor = TokenizerActor(
            tokenizer,
            max_len,
            self.sessions,
            self._sink(t.tokenized, routing_key),
            self._sink(t.steps, _request_key),
            reply_topics=self.reply_topics,
            capacity=c.max_in_flight,
        )
        self.system.add(actor)
        return actor, t.requests, None

    async def _build_scheduler(self):
        c, t = self.config, self.config.topics
        if not c.routed:
            actor = SchedulerActor(
                [self._sink(t.work, routing_key)],
                self._sink(t.steps, _request_key),
                capacity=c.max_in_flight,
            )
            self.system.add(actor)
            return actor, t.tokenized, TokenizedRequest.model_validate_json
        self.router = await self._router(c.routing)
        assert self.producer is not None
        failover = RunnerFailover(
            self.router, self.producer, c.bootstrap_servers, metrics=self.metrics
        )
        self._failover = asyncio.ensure_future(failover.run())
        sinks: dict[str, KafkaSink] = {}

        def work_topic(topic: str) -> KafkaSink:
            if topic not in sinks:
                sinks[topic] = self._sink(topic, routing_key)
            return sinks[topic]

        actor = SchedulerActor(
            [],
            self._sink(t.steps, _request_key),
            router=self.router,
            work_topic=work_topic,
            metrics=self.metrics,
            capacity=c.max_in_flight,
        )
        self.system.add(actor)
        log.info(
            "routing requests to runners by %s (load margin %d requests; a runner silent for "
            "%.0f s is left out), from the KV events on %s",
            "cached prefix" if c.routing == "kv" else "turns",
            c.load_margin,
            c.runner_dead_after_s,
            t.kv_events,
        )
        return actor, t.tokenized, TokenizedRequest.model_validate_json

    async def _feed_router(self, tail: TopicTail, router: KvRouter) -> None:
        """Apply the runners' KV events to the routing index, as they come."""
        try:
            while True:
                try:
                    async for values in tail.batches():
                        for value in values:
                            try:
                                router.apply(KvEventsMessage.model_validate_json(value))
                            except ValueError as exc:
                                log.warning("a KV event that does not parse was skipped: %s", exc)
                        self.metrics.runners_live.set(len(router.live()))
                except Exception:
                    log.exception("reading the KV events failed; reading on in 1 s")
                    await asyncio.sleep(1.0)
        finally:
            await tail.stop()

    async def _runner(self, kind: str):
        """A runner: "unified" serves requests whole; "prefill" passes each on to a "decode"
        runner after its first token, with its prompt's KV."""
        c, t = self.config, self.config.topics
        engine = await self._engine()
        work, publisher, handoff, kv_files = t.work, None, None, None
        if c.routed:
            work = t.runner_work(c.runner_id)
            publisher = self.kv_events = KvEventPublisher(
                partial(self._send_kv_events, t.kv_events),
                runner_id=c.runner_id,
                work_topic=work,
                work_group=self.group,
                block_size=engine.config.block_size,
                kind=kind,
            )
            kv_files = KvFiles(c.kv_transfer_dir, owner=c.runner_id)
            log.info(
                "%s runner %s reads its own work topic %s and reports its cached blocks and load "
                "to %s every %.0f s",
                kind,
                c.runner_id,
                work,
                t.kv_events,
                publisher.heartbeat_s,
            )
        if kind == "prefill":
            assert kv_files is not None and self.producer is not None
            swept = kv_files.sweep()
            router = await self._router("kv")
            source = None
            if c.kv_transfer_address:
                self.kv_server = KvFileServer(kv_files, c.kv_transfer_address)
                source = self.kv_server.start()
            handoff = PrefillHandoff(
                router, kv_files, self.producer.send, runner_id=c.runner_id, source=source
            )
            log.info(
                "passing each request on to a decode runner after its first token, its prompt's "
                "KV through %s%s%s",
                c.kv_transfer_dir,
                f" and to other hosts from {source}" if source else "",
                f" ({swept} stale KV file(s) of this runner removed)" if swept else "",
            )
        actor = RunnerActor(
            engine,
            self._sink(t.steps, _request_key),
            runner_id=c.runner_id,
            max_queue=c.max_in_flight,
            metrics=self.metrics,
            progress=self.progress,
            max_crashes=c.max_crashes,
            kv_events=publisher,
            handoff=handoff,
            kv_files=kv_files,
        )
        self.system.add(actor)
        self.runner = actor
        return actor, work, TokenizedRequest.model_validate_json

    async def _router(self, policy: str) -> KvRouter:
        """A routing index fed from the runners' KV events, as they come."""
        c, t = self.config, self.config.topics
        router = KvRouter(
            policy=policy, load_margin=c.load_margin, dead_after_s=c.runner_dead_after_s
        )
        tail = TopicTail(c.bootstrap_servers, t.kv_events, since_s=2 * SNAPSHOT_EVERY_S + 5)
        await tail.start()
        self._kv_feed = asyncio.ensure_future(self._feed_router(tail, router))
        try:  # know the runners there are before the first request is routed
            await asyncio.wait_for(tail.caught_up.wait(), timeout=KV_EVENTS_CATCH_UP_S)
        except TimeoutError:
            log.warning("the KV events were not read up to now in %.0f s", KV_EVENTS_CATCH_UP_S)
        return router

    async def _send_kv_events(self, topic: str, message: KvEventsMessage) -> None:
        assert self.producer is not None
        value = message.model_dump_json(exclude_defaults=True).encode()
        await self.producer.send(topic, key=message.runner_id, value=value)

    async def _build_streamer(self):
        actor = self._streamer()
        self.system.add(actor)
        return actor, self.config.topics.steps, StepMessage.model_validate_json

    # -- running -------------------------------------------------------------------------------

    def request_stop(self) -> None:
        self._stop.set()

    async def run(self) -> None:
        """Serve until a signal or an actor failure; then shut down in order. Raises ActorFailed
        when an actor failed (the caller exits non-zero)."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.request_stop)
        await self.start()
        assert self.ingress is not None  # start() made it
        ingress = asyncio.ensure_future(self.ingress.run())
        stop = asyncio.ensure_future(self._stop.wait())
        failed = asyncio.ensure_future(self.system.wait())
        try:
            done, _ = await asyncio.wait(
                {ingress, stop, failed}, return_when=asyncio.FIRST_COMPLETED
            )
            if failed in done:
                failed.result()  # raises ActorFailed
            if ingress in done:
                ingress.result()
                log.error("the consumer stopped unexpectedly; shutting down")
        finally:
            log.info(
                "shutting down: finishing in-flight requests (up to %.0f s)",
                self.config.drain_timeout_s,
            )
            await self.shutdown()
            for task in (ingress, stop, failed):
                task.cancel()
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.remove_signal_handler(sig)

    async def shutdown(self) -> None:
        if self._broker_watch is not None:
            self._broker_watch.cancel()
        for task in (self._kv_feed, self._failover):
            if task is not None:
                task.cancel()
        if self.consumer is not None:
            # Waits for in-flight records (bounded), commits, leaves; not when an actor failed,
            # as what it held will not finish.
            await self.consumer.stop(drain=not self.system_failed())
        if self.kv_events is not None:
            # Out of its group now: what it did not finish can be moved at once.
            await self.kv_events.leave()
        if self.ingress is not None:
            await self.ingress.drain_errors()
        if not self.system_failed():
            await self.system.shutdown(graceful=True)
        for sink in self._sinks:
            await sink.flush()
        if self.engine is not None:
            await asyncio.to_thread(self.engine.close)  # its tensor-parallel workers, if any
        if self.kv_server is not None:
            self.kv_server.stop()
        if isinstance(self.output, PartitionTransactions):
            await self.output.stop()
        if self.progress is not None:
            await self.progress.stop()
        if self.reply_topics is not None:
            await self.reply_topics.stop()
        if self.producer is not None:
            await self.producer.stop()
        if self.sessions is not None:
            await self.sessions.close()
        if self.ops is not None:
            self.ops.stop()

    def system_failed(self) -> bool:
        return any(getattr(a, "failure", None) is not None for a in self.system.actors)


def _request_key(message) -> str:
    return message.request_id


async def run_pipeline(config: PipelineConfig, role: str | None = None) -> int:
    pipeline = Pipeline(config, role)
    try:
        await pipeline.run()
    except ActorFailed as exc:
        log.critical("%s; exiting", exc)
        return 1
    except (RedisRefused, KafkaRefused, KafkaSecurityError) as exc:
        log.critical("%s", exc)
        return 2
    except MembershipLost as exc:
        log.critical("%s; exiting", exc)
        return 1
    except InvalidSessionTimeoutError:
        log.critical(
            "the broker refused --session-timeout-ms %d (outside its group.min.session.timeout.ms "
            "and group.max.session.timeout.ms, 6000 and 1800000 unless configured otherwise)",
            config.session_timeout_ms,
        )
        return 2
    if pipeline.system.failure is not None:  # an actor failed while shutting down
        log.critical("%s during shutdown; exiting", pipeline.system.failure)
        return 1
    return 0


__all__ = ["Pipeline", "PipelineConfig", "ROLES", "Topics", "run_pipeline"]
