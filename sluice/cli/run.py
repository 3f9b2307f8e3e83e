"""`sluice run`: the pipeline, all actors in one process or one role per process."""

from __future__ import annotations

import argparse
import asyncio

from sluice.actors.roles import ROLES
from sluice.cli.generate import add_engine_arguments, engine_config_from_args
from sluice.cli.kafka_security_flags import add_kafka_security_arguments
from sluice.connectors.settings import kafka_bootstrap_servers, redis_url
from sluice.engine.reasoning_formats import FORMATS as REASONING_FORMATS
from sluice.engine.tool_formats import FORMATS


def add_topic_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("kafka")
    group.add_argument(
        "--bootstrap-servers",
        default=None,
        help="Kafka address (env KAFKA_BOOTSTRAP_SERVERS, default 127.0.0.1:9092)",
    )
    group.add_argument(
        "--topic-prefix",
        default="sluice",
        help="topics are PREFIX.requests, PREFIX.tokens, PREFIX.dlq, PREFIX.progress "
        "(default: sluice)",
    )
    add_kafka_security_arguments(group)


def topics_from_args(args: argparse.Namespace):
    from sluice.actors.pipeline import Topics

    p = args.topic_prefix
    return Topics(
        requests=f"{p}.requests",
        tokens=f"{p}.tokens",
        dlq=f"{p}.dlq",
        tokenized=f"{p}.internal.tokenized",
        work=f"{p}.internal.work",
        steps=f"{p}.internal.steps",
        progress=f"{p}.progress",
        kv_events=f"{p}.kv-events",
        replies=getattr(args, "reply_topics", None) or f"{p}.replies.*",
    )


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "run", help="run the pipeline: prompts from Kafka in, token streams out"
    )
    parser.add_argument(
        "--role",
        choices=ROLES,
        help="run one role in this process (default: all four); prefill and decode are runners "
        "that split each request: a prefill runner computes the prompt and first token, then "
        "passes the request on, with the prompt's KV, to a decode runner (needs --routing kv)",
    )
    parser.add_argument(
        "--log-format",
        choices=["text", "json"],
        default=argparse.SUPPRESS,  # (sluice --log-format also works: the default is there)
        help="json: one object per line for log collectors (default: text)",
    )
    parser.add_argument(
        "--config",
        metavar="FILE",
        help="settings from a TOML file (keys are these flags' names: max-in-flight = 32); "
        "flags and environment variables override it",
    )
    add_topic_arguments(parser)
    parser.add_argument(
        "--redis-url",
        default=None,
        help="session store (env REDIS_URL, default redis://127.0.0.1:6379/0)",
    )
    parser.add_argument("--no-sessions", action="store_true", help="do not use Redis")
    parser.add_argument("--group", default="sluice", help="consumer group (roles append -ROLE)")
    parser.add_argument(
        "--group-instance-id",
        metavar="ID",
        help="Kafka's static membership (group.instance.id): restarted under the same ID, the "
        "process takes its partitions back at once instead of after --session-timeout-ms; give "
        "each process its own ID and keep it across restarts (a pod's name in a StatefulSet). "
        "Default: none (a restart waits for the dead member's session to expire)",
    )
    parser.add_argument(
        "--session-timeout-ms",
        type=int,
        default=10_000,
        metavar="MS",
        help="Kafka's session.timeout.ms: a member silent this long is dropped from the group "
        "and its partitions handed on (default 10000; the broker allows 6000-1800000 unless "
        "configured otherwise)",
    )
    parser.add_argument(
        "--partitions", type=int, default=4, help="partitions of topics this creates"
    )
    parser.add_argument(
        "--max-in-flight",
        type=int,
        default=64,
        help="unfinished requests before input partitions pause (backpressure)",
    )
    parser.add_argument(
        "--session-ttl", type=int, default=3600, help="seconds a session is remembered"
    )
    parser.add_argument(
        "--redis-outage-wait-s",
        type=float,
        default=30.0,
        help="how long session turns wait for Redis when it goes away while serving (a restart, "
        "a failover) before they are served without their history",
    )
    parser.add_argument(
        "--reply-topics",
        metavar="PATTERN",
        help="the topics a request may name as reply_topic, shell-style "
        "(default: PREFIX.replies.*; never the pipeline's own topics)",
    )
    parser.add_argument(
        "--create-reply-topics",
        action="store_true",
        help="create a missing reply topic (default: the request gets an error event)",
    )
    parser.add_argument(
        "--delivery",
        choices=["at-least-once", "exactly-once"],
        default="at-least-once",
        help="at-least-once: events may repeat after a crash (same content; consumers drop "
        "copies by request id and seq); exactly-once: one transaction per input partition, "
        "read_committed consumers see each event once (docs/DELIVERY.md)",
    )
    parser.add_argument(
        "--commit-interval-ms",
        type=int,
        help="how often input offsets (and, exactly-once, transactions) commit "
        "(default: 100 exactly-once, 1000 at-least-once)",
    )
    parser.add_argument(
        "--max-crashes",
        type=int,
        default=5,
        help="dead-letter a request the process stopped serving this many times in a row "
        "without it getting further (default 5)",
    )
    parser.add_argument(
        "--tenant-topics",
        action="store_true",
        help="also read PREFIX.requests.<tenant> topics, whose name sets the request's tenant "
        "(a different tenant in the request is refused): Kafka ACLs then decide who may act "
        "as which tenant",
    )
    parser.add_argument(
        "--event-format",
        choices=["sluice", "openai"],
        default="sluice",
        help="the events of requests that do not choose: sluice's token/final events, or "
        "OpenAI's chat.completion.chunk objects (an OpenAI-shaped request gets OpenAI's "
        "unless it sets event_format; docs/SCHEMAS.md)",
    )
    parser.add_argument(
        "--tool-call-parser",
        choices=sorted(FORMATS),
        help="how the model writes tool calls (default: chosen from its chat template; hermes "
        "where the template does not render tools, sluice then describing them)",
    )
    parser.add_argument(
        "--reasoning-parser",
        choices=sorted(REASONING_FORMATS),
        help="how a reasoning model's thinking is told from its answer: qwen3 (<think>...</think> "
        "the model opens), deepseek_r1 (opened by the chat template); it goes to the events' "
        "`reasoning` (default: none, the text is all content)",
    )
    parser.add_argument(
        "--metrics-port",
        type=int,
        help="serve Prometheus metrics (/metrics) and the /healthz and /readyz probes on this port",
    )
    parser.add_argument(
        "--runner-id",
        help="name of this runner (default: host and pid); with --routing kv or round-robin it "
        "names the runner's work topic PREFIX.internal.work.ID, so keep it across restarts",
    )
    parser.add_argument(
        "--routing",
        choices=["session", "kv", "round-robin"],
        default="session",
        help="how the scheduler role picks a runner: session (the shared work topic keyed by "
        "session; Kafka spreads its partitions), kv (the runner caching the longest prefix of "
        "the prompt, learnt from the runners' KV events on PREFIX.kv-events) or round-robin; "
        "the scheduler and every runner must be given the same (default: session)",
    )
    parser.add_argument(
        "--load-margin",
        type=int,
        default=8,
        help="kv routing: a runner holding this many requests more than the least loaded one "
        "is passed over, whatever it has cached (default 8)",
    )
    parser.add_argument(
        "--runner-dead-after-s",
        type=float,
        default=10.0,
        help="routed modes: a runner whose KV events stopped this long is not routed to "
        "(default 10; runners report every second)",
    )
    parser.add_argument(
        "--kv-transfer-dir",
        help="prefill/decode runners: the directory where a prefill runner leaves a prompt's KV "
        "for its decode runner; both must see it, so they run on one host (default: "
        "/dev/shm/sluice-kv where there is /dev/shm)",
    )
    parser.add_argument(
        "--kv-transfer-address",
        metavar="HOST:PORT",
        help="prefill runners: serve KV files over TCP here, so that decode runners on other "
        "hosts fetch them (without it, decode runners elsewhere compute the prompt again)",
    )
    parser.add_argument(
        "--drain-timeout",
        type=float,
        default=60.0,
        help="seconds to let in-flight requests finish on shutdown",
    )
    add_engine_arguments(parser)
    parser.set_defaults(func=run, settings_parser=parser)


def run(args: argparse.Namespace) -> int:
    from sluice.actors.pipeline import (
        PipelineConfig,
        run_pipeline,
    )  # loads torch: only when running

    config = PipelineConfig(
        model=args.model,
        engine=engine_config_from_args(args),
        bootstrap_servers=args.bootstrap_servers or kafka_bootstrap_servers(),
        redis_url=None if args.no_sessions else (args.redis_url or redis_url()),
        topics=topics_from_args(args),
        partitions=args.partitions,
        group=args.group,
        group_instance_id=args.group_instance_id,
        session_timeout_ms=args.session_timeout_ms,
        max_in_flight=args.max_in_flight,
        session_ttl_s=args.session_ttl,
        redis_outage_wait_s=args.redis_outage_wait_s,
        metrics_port=args.metrics_port,
        drain_timeout_s=args.drain_timeout,
        create_reply_topics=args.create_reply_topics,
        max_crashes=args.max_crashes,
        delivery=args.delivery,
        commit_interval_ms=args.commit_interval_ms,
        event_format=args.event_format,
        tool_call_parser=args.tool_call_parser,
        reasoning_parser=args.reasoning_parser,
        tenant_topics=args.tenant_topics,
        routing=args.routing,
        load_margin=args.load_margin,
        runner_dead_after_s=args.runner_dead_after_s,
    )
    if args.runner_id:
        config.runner_id = args.runner_id
    if args.kv_transfer_dir:
        config.kv_transfer_dir = args.kv_transfer_dir
    if args.kv_transfer_address:
        config.kv_transfer_address = args.kv_transfer_address
    return asyncio.run(run_pipeline(config, args.role))
