"""`sluice tail`: print token streams from PREFIX.tokens as they arrive.

With request ids it prints those requests' text (one: raw text; several: one after another, each
under a header) and a summary line per final event, and exits once all have finished. It reads
from the beginning of the topic (or `--since`), keeping only records keyed by those ids, so it
sees a request's whole stream however long after `sluice produce` it starts. Without ids it
follows every request from the end of the topic (or `--from-beginning`) until Ctrl-C, each line
prefixed with its request id, and reports dead letters from PREFIX.dlq on stderr.
"""

from __future__ import annotations

import argparse
import sys

from sluice.cli.client import (
    EXIT_FAILED,
    EXIT_OK,
    EXIT_TIMEOUT,
    EventStream,
    Grouped,
    JsonLines,
    Prefixed,
    Renderer,
    Topics,
    add_kafka_arguments,
    bootstrap_from_args,
    follow,
    parse_since,
    quiet_logging,
    run_async,
)


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "tail",
        help="print token streams as they arrive (named requests, or all of them)",
        description="Print token streams from PREFIX.tokens. Duplicate (request_id, seq) events "
        "are dropped. With REQUEST_IDs: exit once each has a final or error event (status 1 if "
        "any failed). Without: follow every request until Ctrl-C.",
    )
    parser.add_argument("request_ids", nargs="*", metavar="REQUEST_ID")
    parser.add_argument("--json", action="store_true", help="print each event as a JSON line")
    start = parser.add_mutually_exclusive_group()
    start.add_argument(
        "--from-beginning",
        action="store_true",
        help="without ids: start at the beginning of the topic, not its end",
    )
    start.add_argument(
        "--since",
        type=parse_since,
        metavar="DURATION",
        help="start at records this long ago (90, 10m, 2h, 1d) instead of the beginning "
        "(with ids) or the end (without)",
    )
    parser.add_argument(
        "--topic", help="read this topic instead of PREFIX.tokens (a request's reply_topic)"
    )
    parser.add_argument(
        "--timeout", type=float, help="with ids: give up after this many seconds (exit 124)"
    )
    add_kafka_arguments(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    quiet_logging(args)
    return run_async(tail(args), "tail", interrupted=EXIT_OK)


async def tail(args: argparse.Namespace) -> int:
    topics = Topics.from_args(args)
    ids = list(dict.fromkeys(args.request_ids)) or None
    names = [args.topic or topics.tokens] + ([] if ids or args.topic else [topics.dlq])
    async with EventStream(bootstrap_from_args(args), names, ids) as stream:

        def waiting(missing: list[str]) -> None:
            print(
                f"sluice tail: waiting for topic {', '.join(missing)} to exist "
                "(is `sluice run` started?)",
                file=sys.stderr,
                flush=True,
            )

        created_meanwhile = not set(names[:1]) <= await stream.existing(names[:1])
        await stream.wait_for_topics(waiting, optional=[topics.dlq])
        if args.since is not None:
            await stream.seek(args.since)
        elif ids or args.from_beginning or created_meanwhile:
            await stream.seek("beginning")
        else:
            await stream.seek("end")
        render: Renderer
        if args.json:
            render = JsonLines()
        elif ids:
            render = Grouped(ids)
        else:
            render = Prefixed()
        left = await follow(stream, render, ids, timeout=args.timeout if ids else None)
    if left:
        print(
            f"sluice tail: gave up after {args.timeout:g} s; unfinished: {' '.join(sorted(left))}",
            file=sys.stderr,
        )
        return EXIT_TIMEOUT
    return EXIT_FAILED if render.errors else EXIT_OK
