"""`sluice stack up | down | status`: the local Kafka + Redis stack."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from sluice.connectors.settings import StackSettings
from sluice.connectors.stack import LocalStack, StackError


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "stack", help="start, stop or check the local Kafka broker and Redis (no Docker needed)"
    )
    parser.add_argument("action", choices=["up", "down", "status"])
    parser.add_argument(
        "--kafka-port", type=int, help="broker port (env SLUICE_KAFKA_PORT, default 9092)"
    )
    parser.add_argument(
        "--kafka-controller-port",
        type=int,
        help="KRaft controller port (env SLUICE_KAFKA_CONTROLLER_PORT, default 9093)",
    )
    parser.add_argument(
        "--redis-port", type=int, help="Redis port (env SLUICE_REDIS_PORT, default 6379)"
    )
    parser.add_argument(
        "--redis-password",
        help="make Redis require this password (env SLUICE_REDIS_PASSWORD; REDIS_URL carries it)",
    )
    parser.add_argument(
        "--kafka-sasl-ssl",
        action="store_true",
        help="the broker takes clients on SASL_SSL only: TLS with a CA made here, users logging "
        "in with PLAIN or SCRAM-SHA-256/512 (env SLUICE_KAFKA_SASL_SSL=1); prints the KAFKA_* "
        "settings clients need",
    )
    parser.add_argument(
        "--home", type=Path, help="data directory (env SLUICE_HOME, default ./.sluice)"
    )
    parser.set_defaults(func=run)


def settings_from_args(args: argparse.Namespace) -> StackSettings:
    settings = StackSettings()
    if args.kafka_port:
        settings.kafka_port = args.kafka_port
    if args.kafka_controller_port:
        settings.kafka_controller_port = args.kafka_controller_port
    if args.redis_port:
        settings.redis_port = args.redis_port
    if args.redis_password:
        settings.redis_password = args.redis_password
    if args.kafka_sasl_ssl:
        settings.kafka_sasl_ssl = True
    if args.home:
        settings.home = args.home.resolve()
    return settings


def run(args: argparse.Namespace) -> int:
    try:
        settings = settings_from_args(args)
    except ValueError as exc:
        print(f"sluice stack: {exc}", file=sys.stderr)
        return 2
    stack = LocalStack(settings)
    try:
        if args.action == "up":
            started = stack.up()
            for name in ("redis", "kafka"):
                print(f"{name}: {'started' if started[name] else 'already running'}")
            print(f"KAFKA_BOOTSTRAP_SERVERS={settings.bootstrap_servers}")
            print(f"REDIS_URL={settings.redis_url}")
            _print_kafka_security(stack)
            return 0
        if args.action == "down":
            stopped = stack.down()
            for name in ("kafka", "redis"):
                print(f"{name}: {'stopped' if stopped[name] else 'not running'}")
            return 0
        status = stack.status()
        print(
            f"kafka: {_describe(status.kafka_pid, status.kafka_answers)} "
            f"{settings.bootstrap_servers}"
        )
        print(f"redis: {_describe(status.redis_pid, status.redis_answers)} {settings.redis_url}")
        _print_kafka_security(stack)
        return 0 if status.healthy else 1
    except StackError as exc:
        print(f"sluice stack {args.action}: {exc}", file=sys.stderr)
        return 1


def _print_kafka_security(stack: LocalStack) -> None:
    listener = stack.kafka.sasl_ssl()
    if listener is None:
        return
    for name, value in listener.client_environment().items():
        print(f"{name}={value}")
    print(f"# the broker takes SASL_SSL only: `source {stack.kafka.client_env_file}` sets these")


def _describe(pid: int | None, answers: bool) -> str:
    if pid is None:
        return "down"
    return f"up (pid {pid})" if answers else f"not answering (pid {pid})"
