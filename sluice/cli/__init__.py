"""The `sluice` command line. Each subcommand lives in its own module with a `register`."""

from __future__ import annotations

import argparse
import sys

from sluice import __version__
from sluice.cli import (
    agent,
    bench,
    chat,
    demo,
    generate,
    models,
    produce,
    replay,
    run,
    schema,
    stack,
    tail,
    tools,
)
from sluice.cli.config_file import ConfigError, defaults_from_file
from sluice.cli.kafka_security_flags import export_kafka_security
from sluice.cli.logs import setup_logging


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="sluice",
        description="Streaming LLM inference where the message queue is the interface.",
    )
    parser.add_argument("--version", action="version", version=f"sluice {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    parser.add_argument(
        "--log-format",
        choices=["text", "json"],
        default="text",
        help="json: one object per line (time, level, logger, message, exception) for log "
        "collectors",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    commands = (
        stack,
        generate,
        run,
        produce,
        tail,
        chat,
        demo,
        replay,
        schema,
        bench,
        models,
        tools,
        agent,
    )
    for module in commands:
        module.register(sub)
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, with a command's `--config FILE` under it (flags > environment > file >
    defaults)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "config", None):
        try:
            defaults = defaults_from_file(args.config, args.settings_parser)
        except ConfigError as exc:
            parser.error(str(exc))
        args.settings_parser.set_defaults(**defaults)
        args = parser.parse_args(argv)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    setup_logging(args.log_format, args.verbose)
    export_kafka_security(args)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
