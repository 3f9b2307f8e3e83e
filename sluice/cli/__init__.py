"""The `sluice` command line. Each subcommand lives in its own module with a `register`."""

from __future__ import annotations

import argparse
import logging
import sys

from sluice import __version__
from sluice.cli import chat, demo, generate, produce, replay, run, schema, stack, tail


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="sluice",
        description="Streaming LLM inference where the message queue is the interface.",
    )
    parser.add_argument("--version", action="version", version=f"sluice {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in (stack, generate, run, produce, tail, chat, demo, replay, schema):
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
