"""`sluice agent`: the reasoning harness over Kafka.

``sluice agent serve`` runs the harness service (`sluice/harness/service.py`) beside a pipeline
(`sluice run`) and tool workers (`sluice tools serve`). ``sluice agent run QUESTION --python``
asks it for a run and prints the run's steps as they happen, then its answer. ``sluice agent
approve RUN_ID KEY`` (or ``--deny``) decides on a call of a tool the run marked `needs_approval`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
import uuid
from typing import Any

from sluice.cli.client import (
    EXIT_FAILED,
    EXIT_OK,
    EXIT_TIMEOUT,
    ClientError,
    add_kafka_arguments,
    bootstrap_from_args,
    run_async,
)
from sluice.cli.formats import TOOL_CHOICE_HELP, tool_choice_arg, tools_arg


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "agent", help="the reasoning harness: model turns and tool calls as a durable loop"
    )
    actions = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    serve = actions.add_parser("serve", help="run the harness service until stopped")
    serve.add_argument(
        "--redis-url",
        help="where runs' sessions live (env REDIS_URL, default redis://127.0.0.1:6379/0)",
    )
    serve.add_argument(
        "--no-sessions", action="store_true", help="no Redis: a run's session_id is not read"
    )
    serve.add_argument(
        "--keep-ended-s",
        type=float,
        default=3600.0,
        help="forget a run this long after it ended: a request with its id is then a new run "
        "(default 3600)",
    )
    add_kafka_arguments(serve)
    serve.set_defaults(func=run_serve)

    ask = actions.add_parser("run", help="ask the harness a question and print the run")
    ask.add_argument("question")
    ask.add_argument("--system", help="a system message before the question")
    ask.add_argument("--tools", type=tools_arg, help="tools (JSON array or @FILE)")
    ask.add_argument("--python", action="store_true", help="offer the sandboxed python tool")
    ask.add_argument("--tool-choice", type=tool_choice_arg, help=TOOL_CHOICE_HELP)
    ask.add_argument("--max-steps", type=int, help="most model turns (default 8)")
    ask.add_argument("--max-tool-calls", type=int, help="most tool calls (default 16)")
    ask.add_argument("--max-tokens", type=int, help="most tokens of one turn (default 512)")
    ask.add_argument("--temperature", type=float, help="default 0 (greedy)")
    ask.add_argument("--seed", type=int)
    ask.add_argument("--timeout-s", type=float, help="the run's wall-clock budget (default 600)")
    verify = ask.add_mutually_exclusive_group()
    verify.add_argument(
        "--self-consistency",
        type=int,
        metavar="N",
        help="run N samples (each a whole run) and answer with what most of them answer",
    )
    verify.add_argument(
        "--best-of",
        type=int,
        metavar="N",
        help="run N samples and answer with the one --scorer scores highest",
    )
    verify.add_argument(
        "--judge",
        metavar="TOOL",
        help='put each answer to TOOL ({question, answer}): it passes on true or {"pass": true}; '
        "otherwise the model hears its feedback and answers again",
    )
    ask.add_argument(
        "--max-answers",
        type=int,
        metavar="N",
        help="--judge: the most answers the judge sees (default 3)",
    )
    ask.add_argument("--scorer", metavar="TOOL", help="--best-of: the tool that scores an answer")
    ask.add_argument(
        "--answer-pattern",
        metavar="REGEX",
        help="--self-consistency: samples vote with its last match in their answers",
    )
    ask.add_argument(
        "--needs-approval",
        action="append",
        metavar="TOOL",
        help="calls of TOOL wait for `sluice agent approve` (repeatable)",
    )
    ask.add_argument(
        "--approval-timeout-s",
        type=float,
        help="a call not approved this long after it was made is denied (default 300)",
    )
    ask.add_argument(
        "--session-id",
        help="continue this session's conversation (a chat's, or an earlier run's) and add the "
        "run to it",
    )
    ask.add_argument("--tenant", help="the session's tenant")
    ask.add_argument("--run-id", help="default: a fresh uuid4 hex")
    ask.add_argument(
        "--stream", action="store_true", help="show each turn's text as it is generated"
    )
    ask.add_argument("--json", action="store_true", help="print each event as a JSON line")
    ask.add_argument("--wait", type=float, default=900, help="give up after this many seconds")
    add_kafka_arguments(ask)
    ask.set_defaults(func=run_ask)

    approve = actions.add_parser(
        "approve", help="approve (or --deny) a call that waits for approval"
    )
    approve.add_argument("run_id")
    approve.add_argument("key", help="the call's key (its awaiting_approval step shows it)")
    approve.add_argument("--deny", action="store_true", help="deny it instead")
    approve.add_argument("--reason", help="with --deny: told to the model")
    approve.add_argument("--by", help="who decides (kept in the run's record)")
    add_kafka_arguments(approve)
    approve.set_defaults(func=run_approve)


def run_serve(args: argparse.Namespace) -> int:
    from sluice.connectors.settings import redis_url
    from sluice.harness.service import serve

    sessions = None if args.no_sessions else (args.redis_url or redis_url())
    try:
        asyncio.run(
            serve(bootstrap_from_args(args), args.topic_prefix, sessions, args.keep_ended_s)
        )
    except KeyboardInterrupt:
        return EXIT_OK
    return EXIT_OK


def request_body(args: argparse.Namespace) -> dict[str, Any]:
    tools = list(args.tools or [])
    if args.python:
        from sluice.tools.python_tool import DEFINITION

        tools.append(DEFINITION)
    if not tools:
        raise ClientError("give the run tools: --tools FILE or --python")
    messages = [{"role": "system", "content": args.system}] if args.system else []
    body: dict[str, Any] = {
        "run_id": args.run_id or uuid.uuid4().hex,
        "messages": messages + [{"role": "user", "content": args.question}],
        "tools": tools,
    }
    for name in (
        "tool_choice",
        "max_steps",
        "max_tool_calls",
        "max_tokens",
        "temperature",
        "seed",
        "timeout_s",
        "needs_approval",
        "approval_timeout_s",
        "session_id",
        "tenant",
    ):
        if getattr(args, name) is not None:
            body[name] = getattr(args, name)
    if args.stream:
        body["stream"] = True
    if args.self_consistency is not None:
        body["verifier"] = {"type": "self-consistency", "n": args.self_consistency}
        if args.answer_pattern is not None:
            body["verifier"]["answer_pattern"] = args.answer_pattern
    elif args.best_of is not None:
        body["verifier"] = {"type": "best-of-n", "n": args.best_of, "scorer": args.scorer}
    elif args.judge is not None:
        body["verifier"] = {"type": "tool", "judge": args.judge}
        if args.max_answers is not None:
            body["verifier"]["n"] = args.max_answers
    if (
        (args.scorer and args.best_of is None)
        or (args.answer_pattern and args.self_consistency is None)
        or (args.max_answers is not None and args.judge is None)
    ):
        raise ClientError(
            "--scorer goes with --best-of, --answer-pattern with --self-consistency, "
            "--max-answers with --judge"
        )
    return body


def run_ask(args: argparse.Namespace) -> int:
    return run_async(ask(args), "agent run")


def run_approve(args: argparse.Namespace) -> int:
    return run_async(decide(args), "agent approve")


async def decide(args: argparse.Namespace) -> int:
    from aiokafka import AIOKafkaProducer
    from pydantic import ValidationError

    from sluice.connectors.kafka_security import kafka_client_options
    from sluice.connectors.topics import ensure_topics
    from sluice.harness.service import PARTITIONS, harness_topics
    from sluice.schemas.harness import Approval

    try:
        approval = Approval(
            run_id=args.run_id,
            key=args.key,
            approved=not args.deny,
            reason=args.reason,
            by=args.by,
        )
    except ValidationError as e:
        raise ClientError(f"not a valid approval: {e.errors()[0]['msg']}") from None
    bootstrap = bootstrap_from_args(args)
    topic = harness_topics(args.topic_prefix)["approvals"]
    await ensure_topics(bootstrap, {topic: PARTITIONS})
    producer = AIOKafkaProducer(
        bootstrap_servers=bootstrap, enable_idempotence=True, **kafka_client_options()
    )
    await producer.start()
    try:
        value = approval.model_dump_json(exclude_none=True).encode()
        await producer.send_and_wait(topic, key=approval.run_id.encode(), value=value)
    finally:
        await producer.stop()
    print(f"{'denied' if args.deny else 'approved'} {approval.key}", file=sys.stderr)
    return EXIT_OK


async def ask(args: argparse.Namespace) -> int:
    from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
    from pydantic import ValidationError

    from sluice.connectors.kafka_security import kafka_client_options
    from sluice.connectors.topics import ensure_topics
    from sluice.harness.service import PARTITIONS, harness_topics
    from sluice.schemas.harness import HarnessRequest
    from sluice.schemas.parse import error_from_validation

    try:
        request = HarnessRequest.model_validate(request_body(args))
    except ValidationError as e:
        refused = error_from_validation(e, None, HarnessRequest)
        raise ClientError(f"not a valid run: {refused.message}") from None
    bootstrap = bootstrap_from_args(args)
    topics = harness_topics(args.topic_prefix)
    counts = await ensure_topics(
        bootstrap, {topics["requests"]: PARTITIONS, topics["events"]: PARTITIONS}
    )
    consumer = AIOKafkaConsumer(
        bootstrap_servers=bootstrap, enable_auto_commit=False, **kafka_client_options()
    )
    await consumer.start()
    producer = AIOKafkaProducer(
        bootstrap_servers=bootstrap, enable_idempotence=True, **kafka_client_options()
    )
    await producer.start()
    try:
        partitions = [TopicPartition(topics["events"], p) for p in range(counts[topics["events"]])]
        consumer.assign(partitions)
        await consumer.seek_to_end(*partitions)
        for tp in partitions:
            await consumer.position(tp)  # (fixed now: nothing after the publish is missed)
        value = request.model_dump_json(exclude_none=True).encode()
        await producer.send_and_wait(topics["requests"], key=request.run_id.encode(), value=value)
        print(f"run {request.run_id}", file=sys.stderr)
        return await _follow(consumer, request.run_id, args.json, args.wait)
    finally:
        await producer.stop()
        await consumer.stop()


async def _follow(consumer: Any, run_id: str, as_json: bool, wait: float) -> int:
    """Print the run's events, and its samples' (a verifier's run), once each, until its final."""
    seen: set[tuple[Any, ...]] = set()
    streamed: set[tuple[str, int]] = set()  # turns whose text was shown as it came (--stream)
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline:
        batch = await consumer.getmany(timeout_ms=500)
        for records in batch.values():
            for record in records:
                event = json.loads(record.value)
                of = event.get("run_id")
                if not isinstance(of, str) or (of != run_id and not _sample(of, run_id)):
                    continue
                delta = event.get("type") == "delta"
                name = (of, event["step"], event["index"]) if delta else (of, event.get("seq"))
                if name in seen:
                    continue
                seen.add(name)
                if as_json:
                    print(json.dumps(event, ensure_ascii=False), flush=True)
                else:
                    _show(event, run_id, streamed)
                if event.get("type") == "harness_final" and of == run_id:
                    return EXIT_OK if event["stop_reason"] == "answer" else EXIT_FAILED
    return EXIT_TIMEOUT


def _show(event: dict[str, Any], run_id: str, streamed: set[tuple[str, int]]) -> None:
    """Print an event as a line; a turn's deltas (--stream) as its text grows, on one line."""
    of = event["run_id"]
    sample = f"[sample {of[len(run_id) + 2 :]}] " if of != run_id else ""
    turn = (of, event.get("step", -1))
    if event.get("type") == "delta":
        if turn not in streamed:
            streamed.add(turn)
            print(f"{sample}[turn {event['step']}] ", end="")
        print(event.get("text") or "", end="", flush=True)
    elif event.get("kind") == "model" and turn in streamed:  # (its text was shown as it came)
        calls = [c["function"]["name"] for c in event.get("tool_calls") or []]
        print(f" -> calls {', '.join(calls)}" if calls else "", flush=True)
    else:
        print(sample + _line(event), flush=True)


def _how(candidate: dict[str, Any]) -> str:
    if "score" in candidate:
        return f"score {candidate['score']}"
    if candidate.get("vote") is not None:
        return f"votes {candidate['vote'][:40]!r}"
    return str(candidate.get("stop_reason", "not ended"))


def _sample(of: str, run_id: str) -> bool:
    """Whether run `of` is a sample of `run_id` (RUN.s0, RUN.s1, ...)."""
    return of.startswith(run_id + ".s") and of[len(run_id) + 2 :].isdigit()


def _line(event: dict[str, Any]) -> str:
    if event.get("type") == "harness_final":  # (its answer is the last turn's text, shown)
        failure = f" ({event['error']})" if event.get("error") else ""
        summary = (
            f"[{event['stop_reason']}{failure}: {event['steps']} turns, "
            f"{event['tool_calls']} tool calls, {event['completion_tokens']} tokens, "
            f"{event['seconds']:.1f} s]"
        )
        if not event.get("candidates"):
            return summary
        # a verifier's run: its samples' answers were shown as they came; say which it chose
        how = [f"{c['run_id'].rpartition('.')[2]}: " + _how(c) for c in event["candidates"]]
        return f"[samples {'; '.join(how)}]\n{event['answer'].strip()}\n{summary}"
    step = event["step"]
    if event["kind"] == "model":
        calls = ", ".join(c["function"]["name"] for c in event.get("tool_calls") or [])
        said = (event.get("text") or "").strip()
        return (
            f"[turn {step}]"
            + (f" {said}" if said else "")
            + (f" -> calls {calls}" if calls else "")
        )
    if event["kind"] == "tool_call":
        call = event["call"]
        return f"[call {call['key']}] {call['name']}({call['arguments']})"
    if event["kind"] == "awaiting_approval":
        call = event["call"]
        return (
            f"[awaiting approval {call['key']}] sluice agent approve {event['run_id']} "
            f"{call['key']}   (or --deny --reason ...)"
        )
    if event["kind"] == "approval":
        decided = event["approval"]
        said = "approved" if decided["approved"] else "denied"
        by = f" by {decided['by']}" if decided.get("by") else ""
        return f"[{said} {decided['key']}{by}]" + (
            f" {decided['reason']}" if decided.get("reason") else ""
        )
    result = event["result"]
    status = "ok" if result["ok"] else f"error {result.get('error')}"
    return f"[result {result['key']}] {status}: {result['content'].strip()[:500]}"
