"""`sluice bench`: a load generator for a running pipeline, over Kafka, in the spirit of
`vllm bench serve`.

For each offered request rate (``--request-rate 1,2,4,8``; ``inf``: all at once) it publishes
``--num-prompts`` requests of a dataset (`workload.py`) at Poisson (or evenly spaced) arrival
times, at most ``--max-concurrency`` unfinished at once when given, reads their token streams
back, and reports throughput, TTFT / TPOT / ITL / end-to-end percentiles and goodput under
``--slo`` (`bench_report.py`): a table, ``--json FILE``, and ``--plot FILE`` (TTFT and TPOT
against offered load). ``--warmup N`` requests go first and are not counted.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import time
import uuid
from typing import Any

from sluice.cli.bench_report import RequestTimes, figure, parse_slo, report, table
from sluice.cli.client import (
    EXIT_FAILED,
    EXIT_OK,
    ClientError,
    EventStream,
    Publisher,
    Topics,
    add_kafka_arguments,
    bootstrap_from_args,
    describe_rejection,
    quiet_logging,
    request_key,
    run_async,
    validate,
)
from sluice.cli.workload import Workload, arrival_times, requests
from sluice.schemas import ErrorEvent, FinalEvent, GenerateRequest, RequestRejected, encode


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "bench",
        help="load-test a running pipeline over Kafka: throughput, TTFT/TPOT/ITL, goodput",
        description=__doc__.split("\n\n")[0],
    )
    parser.add_argument(
        "--request-rate",
        default="inf",
        help="requests per second, or several (1,2,4,8), or inf: all at once (default inf)",
    )
    parser.add_argument("--max-concurrency", type=int, help="most unfinished requests at once")
    parser.add_argument("--num-prompts", type=int, default=50, help="requests per rate")
    parser.add_argument(
        "--dataset",
        default="sample",
        help="sample (shipped chat prompts), random (random words), or a JSON-lines file "
        "of request objects (default sample)",
    )
    parser.add_argument("--input-len", type=int, default=128, help="random: prompt words")
    parser.add_argument(
        "--output-len", type=int, default=64, help="tokens per request (random: exactly)"
    )
    parser.add_argument(
        "--range-ratio", type=float, default=0.0, help="random: prompt lengths vary by this much"
    )
    parser.add_argument("--arrival", choices=["poisson", "constant"], default="poisson")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=0, help="of the dataset and the arrivals")
    parser.add_argument("--warmup", type=int, default=2, help="requests first, not counted")
    parser.add_argument("--slo", help="goodput's limits, e.g. ttft=500ms,tpot=50ms,e2e=10s")
    parser.add_argument("--json", metavar="FILE", help="write the results as JSON")
    parser.add_argument(
        "--plot", metavar="FILE", help="draw TTFT and TPOT against offered load (PNG)"
    )
    parser.add_argument(
        "--timeout", type=float, default=600.0, help="seconds a rate's requests may take"
    )
    add_kafka_arguments(parser)
    parser.set_defaults(func=main)


def _rates(text: str) -> list[float]:
    try:
        rates = [float(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ClientError(f"--request-rate: {text!r} is not numbers (or inf)") from None
    if not rates or any(r <= 0 or math.isnan(r) for r in rates):
        raise ClientError("--request-rate: rates must be > 0 (or inf)")
    return rates


def _prepared(bodies: list[dict[str, Any]], tag: str) -> list[GenerateRequest]:
    """The requests, checked as the pipeline will check them; streamed as sluice's events,
    which is what this command reads."""
    out = []
    for i, body in enumerate(bodies):
        body = {**body, "request_id": f"bench-{tag}-{i}", "event_format": "sluice", "stream": True}
        try:
            out.append(validate(body))
        except RequestRejected as exc:
            raise ClientError(f"request {i} of the dataset: {describe_rejection(exc)}") from None
    return out


async def _run(
    args: argparse.Namespace,
    publisher: Publisher,
    topics: Topics,
    batch: list[GenerateRequest],
    rate: float,
) -> list[RequestTimes]:
    """Send `batch` at `rate` and read its streams until each has ended (or the timeout)."""
    stream = EventStream(bootstrap_from_args(args), [topics.tokens], request_ids=[])
    times: dict[str, RequestTimes] = {}
    limit = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
    pending: set[str] = set()
    async with stream:
        await stream.wait_for_topics()
        await stream.seek("end")  # before publishing: nothing can slip past
        sent_all = asyncio.Event()

        async def send() -> None:
            start = time.monotonic()
            deliveries = []
            for request, at in zip(batch, arrival_times(len(batch), rate, args.arrival, args.seed)):
                delay = start + at - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)
                if limit is not None:
                    await limit.acquire()
                stream.want(request.request_id)
                pending.add(request.request_id)
                times[request.request_id] = RequestTimes(sent=time.monotonic())
                deliveries.append(
                    await publisher.producer.send(
                        topics.requests, key=request_key(request), value=encode(request)
                    )
                )
            for delivery in deliveries:
                await delivery
            sent_all.set()

        sender = asyncio.ensure_future(send())
        deadline = time.monotonic() + args.timeout
        try:
            while not (sent_all.is_set() and not pending):
                if time.monotonic() > deadline:
                    break
                if sender.done() and sender.exception() is not None:
                    raise sender.exception()  # type: ignore[misc]
                for received in await stream.poll(0.05):
                    now = time.monotonic()
                    event = received.event
                    entry = times.get(event.request_id or "")
                    if entry is None:
                        continue
                    if isinstance(event, FinalEvent):
                        entry.done = now
                        entry.output_tokens = event.usage.completion_tokens
                        entry.prompt_tokens = event.usage.prompt_tokens
                        if event.finish_reason == "error":
                            entry.error = event.error.message if event.error else "error"
                    elif isinstance(event, ErrorEvent):
                        entry.done, entry.error = now, f"{event.code}: {event.message}"
                    elif event.token_ids:
                        entry.token_times.append(now)
                        continue
                    else:
                        continue
                    pending.discard(event.request_id or "")
                    if limit is not None:
                        limit.release()
        finally:
            sender.cancel()
    return list(times.values())


async def _bench(args: argparse.Namespace) -> int:
    rates = _rates(args.request_rate)
    slo = parse_slo(args.slo) if args.slo else {}
    topics = Topics.from_args(args)
    workload = Workload(
        dataset=args.dataset,
        num_prompts=args.num_prompts,
        input_len=args.input_len,
        output_len=args.output_len,
        range_ratio=args.range_ratio,
        seed=args.seed,
        temperature=args.temperature,
    )
    try:
        bodies = requests(workload)
    except (OSError, ValueError) as exc:
        raise ClientError(f"--dataset: {exc}") from None
    run_id = uuid.uuid4().hex[:8]
    rows = []
    failed = 0
    async with Publisher(bootstrap_from_args(args)) as publisher:
        if args.warmup:
            warm = _prepared(bodies[: args.warmup], f"{run_id}-warmup")
            print(f"warm-up: {len(warm)} request(s)", file=sys.stderr)
            await _run(args, publisher, topics, warm, math.inf)
        for number, rate in enumerate(rates):
            batch = _prepared(bodies, f"{run_id}-{number}")
            shown = "all at once" if math.isinf(rate) else f"{rate:g} requests/s"
            print(f"rate {shown}: {len(batch)} requests ...", file=sys.stderr, flush=True)
            times = await _run(args, publisher, topics, batch, rate)
            row = report(times, rate, slo, args.max_concurrency)
            failed += row["failed"]
            print(
                f"  {row['completed']} done, {row['failed']} failed, in {row['duration_s']:.1f} s",
                file=sys.stderr,
            )
            rows.append(row)
    print(table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"workload": vars(workload), "results": rows}, f, indent=2)
            f.write("\n")
    if args.plot:
        try:
            figure(rows, args.plot)
        except ImportError:
            print("--plot needs matplotlib (pip install matplotlib)", file=sys.stderr)
            return EXIT_FAILED
    return EXIT_FAILED if failed else EXIT_OK


def main(args: argparse.Namespace) -> int:
    quiet_logging(args)
    return run_async(_bench(args), "bench")
