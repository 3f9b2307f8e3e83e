"""`sluice demo`: publish a handful of sample prompts to a running pipeline, print each token stream
live, then a table of TTFT, TPOT and cached tokens per request.

One of them is a two-turn session: its second turn is published once the first has finished and
carries only the new user message, so its cached tokens show the pipeline reusing the KV cache of
turn one (the pipeline must run with sessions, i.e. with Redis). `scripts/demo.sh` runs this.
"""

from __future__ import annotations

import argparse
import sys
import time

from sluice.cli.client import (
    EXIT_FAILED,
    EXIT_OK,
    EXIT_TIMEOUT,
    ClientError,
    EventStream,
    Grouped,
    Publisher,
    Topics,
    add_kafka_arguments,
    bootstrap_from_args,
    label_of,
    ms,
    quiet_logging,
    run_async,
    validate,
)
from sluice.schemas import GenerateRequest, new_request_id

# (name, chat?, text). The session's two turns are the first and the last.
SESSION_TURNS = ("Tell me a fun fact about octopuses.", "Tell me one more, about their arms.")
SINGLES = [
    ("haiku", True, "Write a haiku about a river."),
    ("kafka", True, "What is Apache Kafka? Answer in one sentence."),
    ("colours", False, "The three primary colours are"),
    ("sleep", True, "Give me two tips for sleeping well."),
]


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "demo", help="stream sample prompts (with a two-turn session) through a running pipeline"
    )
    parser.add_argument("--max-tokens", type=int, default=64, help="per request (default 64)")
    parser.add_argument("--temperature", type=float, default=0.0, help="default 0: greedy")
    parser.add_argument("--tenant", default="demo")
    parser.add_argument(
        "--timeout", type=float, default=600.0, help="give up after this many seconds"
    )
    add_kafka_arguments(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    quiet_logging(args)
    return run_async(demo(args), "demo", interrupted=130)


def build_requests(args: argparse.Namespace) -> tuple[list[GenerateRequest], GenerateRequest]:
    """The first batch (session turn 1 first) and the session's second turn."""
    tag = f"demo-{new_request_id()[:4]}"
    common = {"max_tokens": args.max_tokens, "temperature": args.temperature}
    session = {"session_id": tag, "tenant": args.tenant, **common}

    def chat(text: str) -> list[dict]:
        return [{"role": "user", "content": text}]

    first = [
        validate({"request_id": f"{tag}-turn1", "messages": chat(SESSION_TURNS[0]), **session})
    ]
    for name, is_chat, text in SINGLES:
        body = {"messages": chat(text)} if is_chat else {"prompt": text}
        first.append(validate({"request_id": f"{tag}-{name}", **body, **common}))
    second = validate({"request_id": f"{tag}-turn2", "messages": chat(SESSION_TURNS[1]), **session})
    return first, second


async def demo(args: argparse.Namespace) -> int:
    topics = Topics.from_args(args)
    bootstrap = bootstrap_from_args(args)
    first, second = build_requests(args)
    turn1 = first[0].request_id
    requests = {r.request_id: r for r in [*first, second]}
    render = Grouped(headers=True)
    async with EventStream(bootstrap, [topics.tokens], requests) as stream:
        missing = {topics.requests, topics.tokens} - await stream.existing(
            [topics.requests, topics.tokens]
        )
        if missing:
            raise ClientError(
                f"topic {', '.join(sorted(missing))} does not exist on {bootstrap}: start the "
                f"pipeline (sluice run --topic-prefix {args.topic_prefix})"
            )
        await stream.seek("end")  # before publishing
        async with Publisher(bootstrap) as publisher:
            print(
                f"publishing {len(first)} requests; {second.request_id} (turn 2 of session "
                f"{second.session_id}) follows once {turn1} has finished\n",
                flush=True,
            )
            for r in first:
                render.add(r.request_id, label_of(r))
            await publisher.publish(topics.requests, first)
            pending = set(r.request_id for r in first)
            deadline = time.monotonic() + args.timeout
            while pending:
                if time.monotonic() > deadline:
                    print(
                        f"\nsluice demo: gave up after {args.timeout:g} s; unfinished: "
                        f"{' '.join(sorted(pending))}",
                        file=sys.stderr,
                    )
                    return EXIT_TIMEOUT
                for received in await stream.poll():
                    render(received)
                    rid = received.event.request_id
                    if received.terminal and rid in pending:
                        pending.discard(rid)
                        if rid == turn1:
                            await publisher.publish(topics.requests, [second])
                            render.add(second.request_id, label_of(second))
                            pending.add(second.request_id)
    print()
    print(table([requests[rid] for rid in render.order], render.finals))
    return EXIT_FAILED if render.errors else EXIT_OK


def table(requests: list[GenerateRequest], finals: dict) -> str:
    head = ("request", "prompt", "cached", "generated", "TTFT", "TPOT", "asked")
    rows = []
    for r in requests:
        f = finals.get(r.request_id)
        if f is None:
            rows.append((r.request_id, "-", "-", "-", "-", "-", "failed"))
            continue
        rows.append(
            (
                r.request_id,
                str(f.usage.prompt_tokens),
                str(f.usage.cached_tokens),
                str(f.usage.completion_tokens),
                ms(f.timings.ttft_s),
                ms(f.timings.tpot_s),
                label_of(r, 40),
            )
        )
    widths = [max(len(row[i]) for row in [head, *rows]) for i in range(len(head))]
    right = {1, 2, 3, 4, 5}

    def line(row: tuple[str, ...]) -> str:
        cells = [
            c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths))
        ]
        return "  ".join(cells).rstrip()

    return "\n".join([line(head), line(tuple("-" * w for w in widths)), *map(line, rows)])
