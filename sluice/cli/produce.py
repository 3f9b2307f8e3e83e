"""`sluice produce`: publish requests to PREFIX.requests and print their ids (optionally follow
their token streams).

Requests are validated here exactly as the pipeline will validate them, so a typo is reported at
once, naming the line and field, instead of coming back later as an error event.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from sluice.cli.client import (
    EXIT_FAILED,
    EXIT_OK,
    EXIT_TIMEOUT,
    EXIT_USAGE,
    ClientError,
    EventStream,
    Grouped,
    JsonLines,
    Publisher,
    Topics,
    add_kafka_arguments,
    add_sampling_arguments,
    bootstrap_from_args,
    describe_rejection,
    flag_fields,
    follow,
    label_of,
    quiet_logging,
    run_async,
    validate,
)
from sluice.schemas import GenerateRequest, RequestRejected


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "produce",
        help="publish prompts (or a JSON-lines file of requests) and print their request ids",
        description="Publish requests to PREFIX.requests (key: session id, else request id) "
        "and print each request id on its own line. Flags set request fields; with --file they "
        "are defaults for fields a line leaves out.",
    )
    parser.add_argument(
        "prompts", nargs="*", metavar="PROMPT", help="one request per prompt ('-': read stdin)"
    )
    parser.add_argument(
        "--file", type=Path, help="JSON lines, one request object per line ('-': stdin)"
    )
    parser.add_argument(
        "--chat",
        action="store_true",
        help="send each prompt as a user chat message (rendered with the chat template)",
    )
    parser.add_argument("--system", help="with --chat: a system message before the prompt")
    parser.add_argument(
        "--session", dest="session_id", help="continue this conversation (prefix-cache reuse)"
    )
    parser.add_argument(
        "--request-id", help="request id for a single prompt (default: a fresh uuid4 hex)"
    )
    add_sampling_arguments(parser)
    parser.add_argument(
        "--json",
        action="store_true",
        help="print {request_id, topic, partition, offset} per request; with --follow, "
        "every event as a JSON line",
    )
    parser.add_argument(
        "--follow",
        "-f",
        action="store_true",
        help="then stream the requests' tokens (as `sluice tail` does) until all finish",
    )
    parser.add_argument(
        "--timeout", type=float, help="with --follow: give up after this many seconds (exit 124)"
    )
    parser.add_argument(
        "--dry-run", action="store_true", help="validate and print ids; publish nothing"
    )
    add_kafka_arguments(parser)
    parser.set_defaults(func=run)


def requests_from_args(args: argparse.Namespace) -> tuple[list[GenerateRequest], list[str]]:
    """The valid requests and one message per bad input (bad ones are not sent)."""
    defaults = flag_fields(args)
    if args.session_id:
        defaults["session_id"] = args.session_id
    if args.file is not None:
        if args.prompts:
            raise ClientError("give prompts or --file, not both")
        if args.request_id:
            raise ClientError(
                "--request-id names one prompt's request; put request_id in the file's lines"
            )
        return _from_file(args.file, defaults)
    prompts = [sys.stdin.read() if p == "-" else p for p in args.prompts]
    if not prompts:
        raise ClientError("nothing to send: give a PROMPT or --file requests.jsonl")
    if args.request_id and len(prompts) > 1:
        raise ClientError("--request-id names one request; it was given with several prompts")
    if args.system and not args.chat:
        raise ClientError("--system needs --chat")
    requests, problems = [], []
    for i, prompt in enumerate(prompts):
        body = dict(defaults)
        if args.request_id:
            body["request_id"] = args.request_id
        if args.chat:
            system = [{"role": "system", "content": args.system}] if args.system else []
            body["messages"] = system + [{"role": "user", "content": prompt}]
        else:
            body["prompt"] = prompt
        try:
            requests.append(validate(body))
        except RequestRejected as exc:
            where = f"prompt {i + 1}: " if len(prompts) > 1 else ""
            problems.append(f"{where}{describe_rejection(exc)}")
    return requests, problems


def _from_file(path: Path, defaults: dict) -> tuple[list[GenerateRequest], list[str]]:
    name = "<stdin>" if str(path) == "-" else str(path)
    try:
        lines = (
            sys.stdin.read().splitlines()
            if str(path) == "-"
            else path.read_text("utf-8").splitlines()
        )
    except (OSError, UnicodeDecodeError) as exc:
        raise ClientError(f"cannot read {name}: {exc}") from None
    requests, problems = [], []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        raw: bytes | str = line
        if defaults:
            try:
                obj = json.loads(line)
            except ValueError:
                obj = None  # validate() says why
            if isinstance(obj, dict):
                raw = json.dumps({**defaults, **obj})
        try:
            requests.append(validate(raw))
        except RequestRejected as exc:
            problems.append(f"{name} line {number}: {describe_rejection(exc)}")
    return requests, problems


def run(args: argparse.Namespace) -> int:
    quiet_logging(args)
    try:
        requests, problems = requests_from_args(args)
    except ClientError as exc:
        print(f"sluice produce: {exc}", file=sys.stderr)
        return EXIT_USAGE
    for problem in problems:
        print(f"sluice produce: not sent: {problem}", file=sys.stderr)
    if problems and not requests:
        return EXIT_FAILED
    if args.dry_run:
        for request in requests:
            print(request.request_id)
        return EXIT_FAILED if problems else EXIT_OK
    code = run_async(produce(args, requests), "produce", interrupted=130)
    return code if code != EXIT_OK else (EXIT_FAILED if problems else EXIT_OK)


async def produce(args: argparse.Namespace, requests: list[GenerateRequest]) -> int:
    topics = Topics.from_args(args)
    reply_topics = sorted({r.reply_topic or topics.tokens for r in requests})
    bootstrap = bootstrap_from_args(args)
    ids = [r.request_id for r in requests]
    async with EventStream(bootstrap, reply_topics, ids) as stream:
        existing = await stream.existing([topics.requests, *reply_topics])
        if topics.requests not in existing:
            raise ClientError(
                f"topic {topics.requests} does not exist on {bootstrap}: start the pipeline "
                f"(sluice run --topic-prefix {args.topic_prefix}), which creates its topics"
            )
        if args.follow:
            missing = [t for t in reply_topics if t not in existing]
            if missing:
                raise ClientError(f"cannot follow: topic {', '.join(missing)} does not exist")
            await stream.seek("end")  # before publishing: no event of ours can come earlier
        async with Publisher(bootstrap) as publisher:
            written = await publisher.publish(topics.requests, requests)
        for request, meta in zip(requests, written):
            if args.json:
                print(
                    json.dumps(
                        {
                            "request_id": request.request_id,
                            "topic": meta.topic,
                            "partition": meta.partition,
                            "offset": meta.offset,
                        }
                    )
                )
            else:
                print(request.request_id)
        sys.stdout.flush()
        if not args.follow:
            return EXIT_OK
        render = (
            JsonLines()
            if args.json
            else Grouped(ids, {r.request_id: label_of(r) for r in requests})
        )
        left = await follow(stream, render, ids, timeout=args.timeout)
    if left:
        print(
            f"sluice produce: gave up after {args.timeout:g} s; "
            f"unfinished: {' '.join(sorted(left))}",
            file=sys.stderr,
        )
        return EXIT_TIMEOUT
    return EXIT_FAILED if render.errors else EXIT_OK
