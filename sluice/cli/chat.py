"""`sluice chat`: an interactive multi-turn chat over Kafka.

Each line read from stdin becomes one chat request carrying the session id and only the new user
message: the pipeline keeps the conversation in Redis and continues it, reusing the KV cache of
the earlier turns. The reply streams live; after it, one line says how many prompt tokens came
from the cache and the TTFT / TPOT. EOF (Ctrl-D) or /quit ends the chat.
"""

from __future__ import annotations

import argparse
import sys

from sluice.cli.client import (
    EXIT_FAILED,
    EXIT_OK,
    ClientError,
    EventStream,
    Publisher,
    Received,
    Renderer,
    StdinLines,
    Topics,
    add_kafka_arguments,
    bootstrap_from_args,
    describe_rejection,
    follow,
    ms,
    quiet_logging,
    run_async,
    validate,
)
from sluice.schemas import ErrorEvent, FinalEvent, RequestRejected, new_request_id

QUIT = ("/quit", "/exit", "/q")


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "chat",
        help="interactive multi-turn chat over Kafka (the session lives in the pipeline)",
        description="Chat line by line. Each turn publishes only the new user message with the "
        "session id; the pipeline remembers the conversation (Redis) and reuses its KV cache. "
        "EOF or /quit exits.",
    )
    parser.add_argument(
        "--session",
        dest="session_id",
        help="session id; use the same one to continue a conversation (default: a new one)",
    )
    parser.add_argument("--tenant", help="sessions and caches are kept apart per tenant")
    parser.add_argument("--system", help="system message, sent with the first turn")
    parser.add_argument(
        "--max-tokens", type=int, default=256, help="most tokens per reply (default 256)"
    )
    parser.add_argument("--temperature", type=float, default=0.7, help="0 is greedy (default 0.7)")
    parser.add_argument("--top-p", type=float, help="nucleus sampling (default 1.0)")
    parser.add_argument("--seed", type=int, help="same seed, same draws")
    parser.add_argument(
        "--timeout",
        type=float,
        default=300.0,
        help="seconds to wait for one reply before giving up (default 300)",
    )
    add_kafka_arguments(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    quiet_logging(args)
    return run_async(chat(args), "chat", interrupted=EXIT_OK)


def turn_stats(event: FinalEvent) -> str:
    u, t = event.usage, event.timings
    return (
        f"[cached {u.cached_tokens} of {u.prompt_tokens} prompt tokens; "
        f"{u.completion_tokens} tokens "
        f"({event.finish_reason}); TTFT {ms(t.ttft_s)}, TPOT {ms(t.tpot_s)}]"
    )


class Reply(Renderer):
    """One turn's reply, streamed; then its stats line."""

    def __init__(self) -> None:
        super().__init__()
        self.text_ended_with_newline = True

    def __call__(self, received: Received) -> None:
        event = received.event
        if isinstance(event, ErrorEvent):
            self._newline()
            self._error(event)
        elif isinstance(event, FinalEvent):
            self._newline()
            print(turn_stats(event), file=self.out, flush=True)
        else:
            if event.text:
                self.out.write(event.text)
                self.out.flush()
                self.text_ended_with_newline = event.text.endswith("\n")

    def _newline(self) -> None:
        if not self.text_ended_with_newline:
            self.out.write("\n")
        self.out.flush()


async def chat(args: argparse.Namespace) -> int:
    topics = Topics.from_args(args)
    bootstrap = bootstrap_from_args(args)
    session = args.session_id or f"chat-{new_request_id()[:12]}"
    base = {"session_id": session, "max_tokens": args.max_tokens, "temperature": args.temperature}
    for name in ("tenant", "top_p", "seed"):
        if getattr(args, name) is not None:
            base[name] = getattr(args, name)
    try:  # flags checked before connecting
        validate({**base, "messages": [{"role": "user", "content": "-"}]})
    except RequestRejected as exc:
        raise ClientError(describe_rejection(exc)) from None
    interactive = sys.stdin.isatty()
    failures = 0
    async with EventStream(bootstrap, [topics.tokens], request_ids=[]) as stream:
        missing = {topics.requests, topics.tokens} - await stream.existing(
            [topics.requests, topics.tokens]
        )
        if missing:
            raise ClientError(
                f"topic {', '.join(sorted(missing))} does not exist on {bootstrap}: start the "
                f"pipeline (sluice run --topic-prefix {args.topic_prefix})"
            )
        await stream.seek("end")  # before the first turn is published
        async with Publisher(bootstrap) as publisher:
            tenant = f", tenant {args.tenant}" if args.tenant else ""
            print(
                f"session {session}{tenant}; /quit or Ctrl-D to leave", file=sys.stderr, flush=True
            )
            lines = StdinLines()
            first = True
            while True:
                if interactive:
                    print("you> ", end="", flush=True)
                line = await lines.get()
                if line is None:
                    if interactive:
                        print()
                    break
                text = line.strip()
                if not text:
                    continue
                if text in QUIT:
                    break
                messages = [{"role": "user", "content": text}]
                if first and args.system:
                    messages.insert(0, {"role": "system", "content": args.system})
                try:
                    request = validate({**base, "messages": messages})
                except RequestRejected as exc:
                    print(f"sluice chat: not sent: {describe_rejection(exc)}", file=sys.stderr)
                    continue
                stream.want(request.request_id)
                await publisher.publish(topics.requests, [request])
                first = False
                reply = Reply()
                left = await follow(stream, reply, [request.request_id], timeout=args.timeout)
                if left:
                    print(
                        f"\nsluice chat: no reply within {args.timeout:g} s "
                        f"(request {request.request_id}); "
                        "is the pipeline running?",
                        file=sys.stderr,
                    )
                    return EXIT_FAILED
                failures += reply.errors
    return EXIT_FAILED if failures else EXIT_OK
