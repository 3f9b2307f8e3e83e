"""`sluice replay`: generate a served request again and say whether it came out the same.

What was served comes from a file of JSON lines, either the events of the request as read from its
token stream (`sluice tail REQUEST_ID --json > events.jsonl`) or a record of `sluice generate
--json`; or straight from Kafka (`--request-id` without a file: its events from PREFIX.tokens or
`--topic`, and the request itself from PREFIX.requests unless `--request` gives it). The request is
run alone with the seed its final event reports, on an engine set up as the recorded provenance
says (dtype, deterministic mode, quantization, KV cache type; the recorded model file when it
exists here, else `--model` or the default model). A session turn's prompt continues its
conversation: replay reads the conversation as it was before that turn from the session's record
in Redis (`--redis-url`; kept as long as the session lives). The report says "identical", or the
first position where the tokens (or logprobs, when they were recorded) differ, and which
provenance fields differ from this engine's.

Exit status: 0 identical, 1 different, 2 bad input.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sluice.cli.client import (
    ClientError,
    EventStream,
    Topics,
    add_kafka_arguments,
    bootstrap_from_args,
    follow,
    quiet_logging,
    start_checked,
    validate,
)
from sluice.connectors.kafka_security import KafkaRefused, KafkaSecurityError
from sluice.connectors.settings import redis_url
from sluice.schemas import FinalEvent, GenerateRequest, TokenEvent
from sluice.schemas.events import LOGPROB_FLOOR

if TYPE_CHECKING:
    from sluice.engine import LLMEngine

EXIT_IDENTICAL, EXIT_DIFFERENT, EXIT_USAGE = 0, 1, 2
KV_CACHE_DTYPES = {"int8": "int8", "float8_e4m3fn": "fp8"}  # provenance name -> setting


@dataclass
class Served:
    """What a request produced, as recorded."""

    request: GenerateRequest
    seed: int
    token_ids: dict[int, list[int]]  # per completion
    logprobs: dict[int, list[float]] = field(default_factory=dict)  # where they were recorded
    provenance: dict[str, Any] = field(default_factory=dict)
    prompt_tokens: int | None = None  # as the final event counted them


@dataclass
class Report:
    identical: bool
    tokens: int  # compared, over all completions
    first_difference: dict[str, Any] | None
    provenance_differences: dict[str, tuple[Any, Any]]
    # whether the provenance promises the recorded bits here, and if not, why (`expectation`)
    expected: bool = False
    why_not: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {
            "identical": self.identical,
            "tokens": self.tokens,
            "first_difference": self.first_difference,
            "provenance_differences": {
                k: {"recorded": a, "here": b} for k, (a, b) in self.provenance_differences.items()
            },
            "expected_to_reproduce": self.expected,
            "why_not": self.why_not,
        }


# What decides deterministic mode's bits besides the numerics version (docs/REPRODUCIBILITY.md):
# the CPU, the build of the kernels, torch's and sluice's versions do not, within one version.
_DECIDING = {
    "weights_sha256": "other weights",
    "tokenizer_sha256": "another tokenizer",
    "chat_template_sha256": "another chat template",
    "dtype": "another dtype",
    "quantization": "another quantization",
    "kv_cache_dtype": "another KV cache type",
    "device": "another kind of device",
    "tool_format": "another tool-call format",
    "reasoning_format": "another reasoning parser",
}
_SINCE = {"tool_format"}  # recorded since a later version: not held against an older record


def expectation(recorded: dict[str, Any], here: dict[str, Any]) -> tuple[bool, list[str]]:
    """Whether a run with provenance `recorded` should give the same bits on an engine with
    provenance `here`, whatever the CPU; if not, the reasons."""
    why = []
    if not recorded:
        return False, ["no provenance was recorded"]
    if not (recorded.get("deterministic") and here.get("deterministic")):
        why.append("not recorded in deterministic mode: its bits depend on the batch and machine")
    if recorded.get("numerics") != here.get("numerics"):
        why.append(
            f"recorded under numerics {recorded.get('numerics')}, this is {here.get('numerics')}"
        )
    why += [
        f"{reason} ({name})"
        for name, reason in _DECIDING.items()
        if recorded.get(name) != here.get(name) and (name in recorded or name not in _SINCE)
    ]
    if recorded.get("dtype") == "bfloat16" and here.get("dtype") == "bfloat16":
        dot = ["avx512_bf16" in (p.get("cpu_features") or []) for p in (recorded, here)]
        if dot[0] != dot[1]:
            why.append("bfloat16 with the bfloat16 dot instruction on one side only (cpu_features)")
    return not why, why


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "replay",
        help="generate a served request again and report whether it came out the same",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "events",
        nargs="?",
        help="JSON lines: the request's events (sluice tail --json), a sluice generate --json "
        "record, or a harness run's events (sluice agent run --json); without it, read them from "
        "Kafka (needs --request-id or --run-id)",
    )
    parser.add_argument("--request-id", help="which request (needed when the source holds several)")
    parser.add_argument(
        "--run-id",
        help="replay a harness run: its model turns again, with the recorded tool results (its "
        "events from the file, else from PREFIX.harness-events)",
    )
    parser.add_argument("--request", help="the original request as a JSON file")
    parser.add_argument(
        "--topic",
        help="read the events from this topic instead of PREFIX.tokens (a run's: "
        "PREFIX.harness-events)",
    )
    parser.add_argument("--timeout", type=float, default=30.0, help="seconds to look on Kafka")
    parser.add_argument("--model", help="run this model instead of the recorded one")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--kv-cache-mb", type=int, default=256)
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument(
        "--redis-url",
        help="where a session turn's conversation is (default: REDIS_URL, else the local stack's)",
    )
    add_kafka_arguments(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from sluice.cli.replay_run import is_run_record

    quiet_logging(args)
    try:
        lines = _read_lines(args.events) if args.events is not None else None
        if args.run_id is not None or (lines is not None and is_run_record(lines)):
            return _replay_run(args, lines)
        if lines is not None:
            served = served_from_lines(lines, args.request_id, _request(args))
        elif args.request_id is None:
            raise ClientError("give a file of events, or --request-id to read them from Kafka")
        else:
            served = asyncio.run(_from_kafka(args))
    except (ClientError, KafkaRefused, KafkaSecurityError) as exc:
        print(f"sluice replay: {exc}", file=sys.stderr)
        return EXIT_USAGE
    try:
        history = None
        if served.request.session_id is not None:
            history = session_history(served.request, args.redis_url or redis_url())
        report = replay(served, args.model, args.device, args.kv_cache_mb << 20, history)
    except ClientError as exc:
        print(f"sluice replay: {exc}", file=sys.stderr)
        return EXIT_USAGE
    print(json.dumps(report.to_dict()) if args.json else describe(served, report))
    return EXIT_IDENTICAL if report.identical else EXIT_DIFFERENT


def _replay_run(args: argparse.Namespace, lines: list[dict] | None) -> int:
    from sluice.cli.replay_run import describe_run, recorded_run, replay_run

    try:
        if lines is None:
            lines = asyncio.run(_run_events(args))
        recorded = recorded_run(lines, args.run_id)
        report = replay_run(recorded, args.model, args.device, args.kv_cache_mb << 20)
    except (ClientError, KafkaRefused, KafkaSecurityError) as exc:
        print(f"sluice replay: {exc}", file=sys.stderr)
        return EXIT_USAGE
    print(json.dumps(report.to_dict()) if args.json else describe_run(recorded, report))
    return EXIT_IDENTICAL if report.identical else EXIT_DIFFERENT


async def _run_events(args: argparse.Namespace) -> list[dict]:
    """A run's events as PREFIX.harness-events (or --topic) holds them."""
    from sluice.harness.service import harness_topics

    topic = args.topic or harness_topics(args.topic_prefix)["events"]
    events = []
    for raw in await _records(args, topic):
        try:
            event = json.loads(raw)
        except ValueError:
            continue
        if isinstance(event, dict) and event.get("run_id") == args.run_id:
            events.append(event)
    if not events:
        raise ClientError(f"no events of run {args.run_id} on {topic}")
    return events


def _read_lines(path: str) -> list[dict]:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ClientError(f"cannot read {path}: {exc}") from exc
    lines = []
    for n, line in enumerate(text.splitlines(), 1):
        if line.strip():
            try:
                lines.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise ClientError(f"{path}:{n}: not JSON: {exc}") from exc
    return lines


def _request(args: argparse.Namespace) -> GenerateRequest | None:
    if args.request is None:
        return None
    try:
        return validate(Path(args.request).read_bytes())
    except OSError as exc:
        raise ClientError(f"cannot read {args.request}: {exc}") from exc


def served_from_lines(
    lines: list[dict], request_id: str | None, request: GenerateRequest | None
) -> Served:
    """The served request in `lines`: events of a token stream, or `sluice generate --json`
    records (which carry their request)."""
    if any("type" not in line for line in lines):
        return _from_generate_records(lines, request_id, request)
    events = [line for line in lines if request_id is None or line.get("request_id") == request_id]
    ids = {e.get("request_id") for e in events}
    if len(ids) != 1:
        raise ClientError(
            f"the events name {len(ids)} requests: give --request-id"
            if ids
            else f"no events of request {request_id!r}"
        )
    if request is None:
        raise ClientError("events alone do not say what was asked: give --request FILE")
    return _from_events(events, request)


def _from_generate_records(
    lines: list[dict], request_id: str | None, request: GenerateRequest | None
) -> Served:
    def named(record: dict) -> bool:
        return request_id is None or record.get("request", {}).get("request_id") == request_id

    records = [r for r in lines if named(r)]
    if len(records) != 1:
        raise ClientError(f"{len(records)} matching records: give --request-id (prompt-N)")
    record = records[0]
    if request is None:
        if "request" not in record:
            raise ClientError("the record does not carry its request: give --request FILE")
        request = validate(json.dumps(record["request"]))
    return Served(
        request=request,
        seed=int(record["seed"]),
        token_ids={0: list(record["token_ids"])},
        provenance=record.get("provenance") or {},
    )


def _from_events(events: list[dict], request: GenerateRequest) -> Served:
    finals = [e for e in events if e.get("type") == "final"]
    if not finals:
        errors = [e for e in events if e.get("type") == "error"]
        what = f"an error ({errors[0].get('code')})" if errors else "no final event"
        raise ClientError(f"request {request.request_id} has {what}: nothing to replay")
    final = FinalEvent.model_validate(finals[0])
    if final.seed is None:
        raise ClientError("the final event carries no seed: it cannot be replayed")
    tokens: dict[int, list[int]] = {}
    logprobs: dict[int, list[float]] = {}
    seen: set[int] = set()
    for raw in sorted((e for e in events if e.get("type") == "token"), key=lambda e: e["seq"]):
        event = TokenEvent.model_validate(raw)
        if event.seq in seen:
            continue  # a copy (at-least-once delivery)
        seen.add(event.seq)
        tokens.setdefault(event.index, []).extend(event.token_ids)
        if event.logprobs is not None:
            logprobs.setdefault(event.index, []).extend(lp.logprob for lp in event.logprobs)
    return Served(
        request=request,
        seed=final.seed,
        token_ids=tokens,
        logprobs=logprobs,
        provenance=final.provenance.model_dump() if final.provenance else {},
        prompt_tokens=final.usage.prompt_tokens,
    )


async def _from_kafka(args: argparse.Namespace) -> Served:
    topics = Topics.from_args(args)
    rid = args.request_id
    async with EventStream(bootstrap_from_args(args), [args.topic or topics.tokens], [rid]) as s:
        await s.seek("beginning")
        events: list[dict] = []
        missing = await follow(s, lambda r: events.append(r.raw), [rid], timeout=args.timeout)
    if missing:
        raise ClientError(f"no final event of {rid} within {args.timeout:.0f} s")
    request = _request(args) or await _find_request(args, topics.requests, rid)
    return _from_events(events, request)


async def _find_request(args: argparse.Namespace, topic: str, request_id: str) -> GenerateRequest:
    """The request `request_id` as published on `topic`."""
    from sluice.schemas import RequestRejected, decode_request

    for raw in await _records(args, topic):
        try:
            request = decode_request(raw)
        except RequestRejected:
            continue
        if request.request_id == request_id:
            return request
    raise ClientError(f"request {request_id} is not on {topic}: give --request FILE")


async def _records(args: argparse.Namespace, topic: str) -> list[bytes]:
    """Every record's value on `topic`, read from the beginning to the end."""
    from aiokafka import AIOKafkaConsumer, TopicPartition

    from sluice.connectors.kafka_security import kafka_client_options

    consumer = AIOKafkaConsumer(
        bootstrap_servers=bootstrap_from_args(args),
        group_id=None,
        enable_auto_commit=False,
        **kafka_client_options(),
    )
    await start_checked(consumer, bootstrap_from_args(args))
    values: list[bytes] = []
    try:
        cluster = await consumer._client.fetch_all_metadata()  # not subscribed: ask the broker
        tps = [TopicPartition(topic, p) for p in sorted(cluster.partitions_for_topic(topic) or ())]
        consumer.assign(tps)
        await consumer.seek_to_beginning(*tps)
        ends = await consumer.end_offsets(tps)
        left = {tp for tp in tps if ends[tp] > 0}
        while left:
            for records in (await consumer.getmany(timeout_ms=1000)).values():
                values += [record.value or b"" for record in records]
            for tp in list(left):
                if await consumer.position(tp) >= ends[tp]:
                    left.discard(tp)
    finally:
        await consumer.stop()
    return values


def session_history(request: GenerateRequest, url: str) -> tuple[list[dict], list[int]]:
    """A session turn's conversation before it (messages, token ids), from the session's record
    in Redis, which keeps where each answered turn started."""
    import redis

    from sluice.connectors.sessions import SessionRecord, redact, session_key

    assert request.session_id is not None
    try:
        with redis.Redis.from_url(url, socket_timeout=10) as client:
            raw = client.get(session_key(request.tenant, request.session_id))
    except redis.RedisError as exc:
        raise ClientError(f"Redis at {redact(url)}: {exc} (give --redis-url)") from exc
    if raw is None:
        raise ClientError(
            f"session {request.session_id!r} is not in Redis at {redact(url)} (expired, or "
            "another Redis: give --redis-url): its turns cannot be replayed"
        )
    record = SessionRecord.model_validate_json(raw)
    if request.request_id not in record.turn_ids:
        raise ClientError(
            f"session {request.session_id!r} has no answered turn {request.request_id!r}"
        )
    return record.before(request.request_id)


def engine_as_recorded(
    recorded: dict[str, Any], model: str | None, device: str, kv_cache_bytes: int
) -> LLMEngine:
    """An engine set up as the provenance `recorded` says (dtype, deterministic mode,
    quantization, KV cache type, tool-call format; the recorded model file when it exists here,
    else `model` or the default model)."""
    from sluice.engine import (
        EngineConfig,
        EngineError,
        LLMEngine,
        reasoning_formats,
        tool_formats,
    )

    dtype = recorded.get("dtype", "float32")
    kv = recorded.get("kv_cache_dtype", dtype)
    config = EngineConfig(
        dtype=dtype,
        device=device,
        kv_cache_bytes=kv_cache_bytes,
        deterministic=bool(recorded.get("deterministic", False)),
        quantization=recorded.get("quantization"),
        kv_cache_dtype=KV_CACHE_DTYPES.get(kv, "auto"),
    )
    recorded_model = recorded.get("model")
    if model is None and recorded_model and Path(recorded_model).exists():
        model = recorded_model
    engine = LLMEngine(model, config)
    tokenizer, tool_format = engine.tokenizer, recorded.get("tool_format")
    if tokenizer is not None and tool_format and tool_format != tokenizer.tool_format.name:
        try:  # (served with --tool-call-parser)
            tokenizer.tool_format = tool_formats.named(tool_format)(tokenizer)
        except EngineError as exc:
            raise ClientError(f"the recorded tool-call format: {exc}") from exc
        engine.provenance = replace(engine.provenance, tool_format=tool_format)
    reasoning = recorded.get("reasoning_format")
    if tokenizer is not None and reasoning:  # (served with --reasoning-parser)
        try:
            tokenizer.reasoning_format = reasoning_formats.named(reasoning)
        except EngineError as exc:
            raise ClientError(f"the recorded reasoning parser: {exc}") from exc
        engine.provenance = replace(engine.provenance, reasoning_format=reasoning)
    return engine


@dataclass
class Alone:
    """A request's completions, generated on an engine of its own."""

    tokens: dict[int, list[int]] = field(default_factory=dict)
    logprobs: dict[int, list[float]] = field(default_factory=dict)
    texts: dict[int, str] = field(default_factory=dict)
    finish_reasons: dict[int, str] = field(default_factory=dict)
    prompt_tokens: int = 0


def run_alone(
    engine: LLMEngine,
    request: GenerateRequest,
    seed: int,
    history: tuple[list[dict], list[int]] | None = None,
) -> Alone:
    """Generate `request` with `seed`, alone; a session turn after `history`."""
    from sluice.actors.conversation import build_prompt
    from sluice.actors.tool_calls import sampling_kwargs
    from sluice.engine import SamplingParams

    prompt = build_prompt(engine.tokenizer, request, *(history or (None, None)))
    params = SamplingParams(**{**sampling_kwargs(request, engine.tokenizer), "seed": seed})
    engine.add_request(request.request_id, params=params, prompt_token_ids=prompt.token_ids)
    alone = Alone(prompt_tokens=len(prompt.token_ids))
    while engine.has_unfinished():
        for out in engine.step():
            alone.tokens.setdefault(out.index, []).extend(out.new_token_ids)
            alone.logprobs.setdefault(out.index, []).extend(
                max(LOGPROB_FLOOR, lp.logprob) for lp in out.logprobs
            )
            alone.texts[out.index] = alone.texts.get(out.index, "") + out.text
            if out.finished:
                alone.finish_reasons[out.index] = out.finish_reason or "stop"
    return alone


def replay(
    served: Served,
    model: str | None,
    device: str,
    kv_cache_bytes: int,
    history: tuple[list[dict], list[int]] | None = None,
) -> Report:
    """Run the request alone as recorded; a session turn after `history` (`session_history`)."""
    request = served.request
    if request.session_id is not None and history is None:
        raise ClientError("a session turn needs its conversation before it (session_history)")
    recorded = served.provenance
    engine = engine_as_recorded(recorded, model, device, kv_cache_bytes)
    if history is not None and served.prompt_tokens is not None:
        from sluice.actors.conversation import build_prompt

        rebuilt = len(build_prompt(engine.tokenizer, request, *history).token_ids)
        if rebuilt != served.prompt_tokens:
            raise ClientError(
                f"the turn's prompt comes to {rebuilt} tokens from the session's record, "
                f"{served.prompt_tokens} when it was served (another tokenizer or chat "
                "template): it cannot be rebuilt here"
            )
    alone = run_alone(engine, request, served.seed, history)
    identical, compared, first = _compare(served, alone.tokens, alone.logprobs)
    expected, why_not = expectation(recorded, engine.provenance.to_dict())
    return Report(
        identical, compared, first, engine.provenance.differences(recorded), expected, why_not
    )


def _compare(
    served: Served, tokens: dict[int, list[int]], logprobs: dict[int, list[float]]
) -> tuple[bool, int, dict[str, Any] | None]:
    compared = 0
    for index in sorted(set(served.token_ids) | set(tokens)):
        want, got = served.token_ids.get(index, []), tokens.get(index, [])
        want_lp, got_lp = served.logprobs.get(index), logprobs.get(index, [])
        for pos in range(max(len(want), len(got))):
            a = want[pos] if pos < len(want) else None
            b = got[pos] if pos < len(got) else None
            if a != b:
                return False, compared, {"index": index, "position": pos, "recorded": a, "here": b}
            if want_lp is not None and pos < len(want_lp) and want_lp[pos] != got_lp[pos]:
                return (
                    False,
                    compared,
                    {
                        "index": index,
                        "position": pos,
                        "token_id": a,
                        "recorded_logprob": want_lp[pos],
                        "here_logprob": got_lp[pos],
                    },
                )
            compared += 1
    return True, compared, None


def describe(served: Served, report: Report) -> str:
    lines = []
    with_lp = " and logprobs" if served.logprobs else ""
    if report.identical:
        lines.append(f"identical: {report.tokens} tokens{with_lp} of {served.request.request_id}")
    else:
        d = report.first_difference or {}
        where = f"completion {d.get('index')}, token {d.get('position')}"
        if "recorded_logprob" in d:
            lines.append(
                f"differs at {where}: same token {d['token_id']}, logprob "
                f"{d['recorded_logprob']!r} recorded, {d['here_logprob']!r} here"
            )
        else:
            lines.append(
                f"differs at {where}: token {d.get('recorded')} recorded, {d.get('here')} here "
                f"(the {report.tokens} before it are identical)"
            )
    if report.expected:
        lines.append(
            f"expected to reproduce on any CPU: deterministic mode, numerics "
            f"{served.provenance.get('numerics')}, the same weights and settings"
        )
    else:
        lines.append("not expected to reproduce: " + "; ".join(report.why_not))
    if report.provenance_differences:
        lines.append("provenance differs from this engine's:")
        for name, (a, b) in sorted(report.provenance_differences.items()):
            lines.append(f"  {name}: {a!r} recorded, {b!r} here")
    elif served.provenance:
        lines.append("provenance: the same as this engine's")
    else:
        lines.append("provenance: none recorded")
    return "\n".join(lines)
