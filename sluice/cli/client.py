"""What the client commands (`produce`, `tail`, `chat`, `demo`) share: their Kafka flags, building
and publishing requests, and reading event streams back without races and without duplicates.

Race-free reading: a command that publishes and then reads (``produce --follow``, ``chat``,
``demo``) takes the end offsets of the tokens topic *before* it publishes and reads from there, so
no event of its requests can slip past. ``tail REQUEST_ID`` started after the fact reads the topic
from its beginning (or ``--since``), keeping only records keyed by the named ids.

Duplicates: after a crash or a rebalance the pipeline may send a request's events again; every
event carries ``(request_id, seq)`` and :class:`EventStream` passes each pair on once.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Coroutine, Iterable
from dataclasses import dataclass
from typing import Any, TextIO

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.errors import KafkaConnectionError

from sluice.cli.formats import (
    RESPONSE_FORMAT_HELP,
    TOOL_CHOICE_HELP,
    TOOLS_HELP,
    response_format_arg,
    tool_choice_arg,
    tools_arg,
)
from sluice.cli.kafka_security_flags import add_kafka_security_arguments
from sluice.connectors.kafka_producer import EventProducer
from sluice.connectors.kafka_security import (
    KafkaRefused,
    KafkaSecurityError,
    check_access,
    kafka_client_options,
)
from sluice.connectors.settings import kafka_bootstrap_servers
from sluice.schemas import (
    ErrorEvent,
    FinalEvent,
    GenerateRequest,
    RequestRejected,
    TokenEvent,
    UnknownEventType,
    decode_event,
    decode_request,
    encode,
)

log = logging.getLogger(__name__)

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_TIMEOUT = 0, 1, 2, 124


class ClientError(Exception):
    """A problem the command reports in one line (exit status 2)."""


# --- flags ------------------------------------------------------------------------------------


def add_kafka_arguments(parser: argparse.ArgumentParser) -> None:
    """The same Kafka flags as `sluice run`, so one prefix names the same topics everywhere."""
    group = parser.add_argument_group("kafka")
    group.add_argument(
        "--bootstrap-servers",
        default=None,
        help="Kafka address (env KAFKA_BOOTSTRAP_SERVERS, default 127.0.0.1:9092)",
    )
    group.add_argument(
        "--topic-prefix",
        default="sluice",
        help="topics are PREFIX.requests, PREFIX.tokens, PREFIX.dlq (default: sluice)",
    )
    add_kafka_security_arguments(group)


def add_sampling_arguments(parser: argparse.ArgumentParser) -> None:
    """Request fields as flags. Each defaults to None: unset flags leave the wire defaults (and,
    for `produce --file`, the line's own values) alone."""
    group = parser.add_argument_group("request")
    group.add_argument("--tenant", help="sessions and caches are kept apart per tenant")
    group.add_argument("--max-tokens", type=int, help="most tokens to generate (default 256)")
    group.add_argument("--temperature", type=float, help="0 is greedy (default 1.0)")
    group.add_argument("--top-p", type=float, help="nucleus sampling (default 1.0)")
    group.add_argument("--seed", type=int, help="same seed, same draws")
    group.add_argument("--stop", action="append", help="stop string (repeatable)")
    group.add_argument("--priority", type=int, help="lower is served sooner (default 0)")
    group.add_argument(
        "--reply-topic", help="send this request's events here instead of PREFIX.tokens"
    )
    group.add_argument("--response-format", type=response_format_arg, help=RESPONSE_FORMAT_HELP)
    group.add_argument("--tools", type=tools_arg, help=TOOLS_HELP)
    group.add_argument("--tool-choice", type=tool_choice_arg, help=TOOL_CHOICE_HELP)


SAMPLING_FLAGS = (
    "tenant",
    "max_tokens",
    "temperature",
    "top_p",
    "seed",
    "stop",
    "priority",
    "reply_topic",
    "response_format",
    "tools",
    "tool_choice",
)


def flag_fields(args: argparse.Namespace) -> dict[str, Any]:
    """The request fields given as flags."""
    return {
        name: getattr(args, name)
        for name in SAMPLING_FLAGS
        if getattr(args, name, None) is not None
    }


def quiet_logging(args: argparse.Namespace) -> None:
    """Client commands print results, not the connectors' start-up lines (unless -v)."""
    if not getattr(args, "verbose", False):
        logging.getLogger().setLevel(logging.WARNING)


@dataclass(frozen=True)
class Topics:
    requests: str
    tokens: str
    dlq: str

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> Topics:
        p = args.topic_prefix
        return cls(requests=f"{p}.requests", tokens=f"{p}.tokens", dlq=f"{p}.dlq")


def bootstrap_from_args(args: argparse.Namespace) -> str:
    return args.bootstrap_servers or kafka_bootstrap_servers()


async def start_checked(client: Any, bootstrap_servers: str) -> None:
    """Start a Kafka client (anything with `start` and `stop`); when no broker took it, say in one
    line whether one refused it (its credentials, certificates or protocol) rather than aiokafka's
    "Unable to bootstrap"."""
    try:
        await client.start()
    except KafkaConnectionError:
        await client.stop()  # release what it opened before failing
        await check_access(bootstrap_servers)  # raises KafkaRefused naming the setting at fault
        raise


# --- requests ---------------------------------------------------------------------------------


def validate(body: dict[str, Any] | bytes | str) -> GenerateRequest:
    """A request as the pipeline will read it; raises RequestRejected naming the bad field."""
    raw = body if isinstance(body, (bytes, str)) else json.dumps(body)
    return decode_request(raw)


def request_key(request: GenerateRequest) -> str:
    """Partition key: the session (so a conversation's turns stay in order), else the request."""
    return request.session_id or request.request_id


def label_of(request: GenerateRequest, width: int = 60) -> str:
    """A one-line reminder of what was asked, for headers and tables."""
    if request.prompt is not None:
        text = request.prompt
    else:
        assert request.messages is not None  # the schema requires prompt or messages
        text = str(request.messages[-1].content)
    text = " ".join(text.split())
    return text if len(text) <= width else text[: width - 1] + "…"


def describe_rejection(exc: RequestRejected) -> str:
    """The rejection in one line; it always names the offending field when there is one."""
    event = exc.event
    text = event.message if event.code == "invalid_request" else f"{event.code}: {event.message}"
    if event.field and not event.message.startswith(event.field):
        text = f"{event.field}: {text}"
    return text


class Publisher:
    """Publishes requests with sluice's idempotent producer; `publish` returns once Kafka has
    them."""

    def __init__(self, bootstrap_servers: str):
        self.bootstrap_servers = bootstrap_servers
        self.producer = EventProducer(
            bootstrap_servers=bootstrap_servers, client_id="sluice-client", linger_ms=0
        )

    async def __aenter__(self) -> Publisher:
        await start_checked(self.producer, self.bootstrap_servers)
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.producer.stop()

    async def publish(self, topic: str, requests: list[GenerateRequest]) -> list[Any]:
        """Send all (in order), then wait for each; returns their record metadata. A request that
        names no event format asks for sluice's, which these commands show, whatever the
        pipeline's --event-format."""
        futures = []
        for r in requests:
            if r.event_format is None:
                r = r.model_copy(update={"event_format": "sluice"})
            futures.append(await self.producer.send(topic, key=request_key(r), value=encode(r)))
        return [await f for f in futures]


# --- reading events ---------------------------------------------------------------------------


@dataclass
class Received:
    topic: str
    event: TokenEvent | FinalEvent | ErrorEvent
    raw: dict[str, Any]  # as sent, unknown fields included (for --json)

    @property
    def terminal(self) -> bool:
        return not isinstance(self.event, TokenEvent)


class EventStream:
    """Reads events from the given topics (all partitions, no consumer group: nothing is
    committed and any number of clients can read the same stream), keeps only the wanted request
    ids (all, when ``request_ids`` is None) and drops duplicate ``(request_id, seq)`` events.
    It reads committed records only (``read_committed``): with exactly-once delivery, events of a
    transaction that was aborted (a crash) are never seen."""

    MAX_TRACKED = 100_000

    def __init__(
        self,
        bootstrap_servers: str,
        topics: Iterable[str],
        request_ids: Iterable[str] | None = None,
        isolation_level: str = "read_committed",
    ):
        self.topics = list(dict.fromkeys(topics))
        self.bootstrap_servers = bootstrap_servers
        self.consumer = AIOKafkaConsumer(
            bootstrap_servers=bootstrap_servers,
            group_id=None,
            enable_auto_commit=False,
            client_id="sluice-client",
            metadata_max_age_ms=5000,
            isolation_level=isolation_level,
            **kafka_client_options(),
        )
        self._wanted: set[bytes] | None = (
            None if request_ids is None else {r.encode() for r in request_ids}
        )
        self._next_seq: OrderedDict[str, int] = OrderedDict()  # per request, most recent last
        self.skipped = 0  # undecodable or unknown events
        self._cluster: Any = None

    async def __aenter__(self) -> EventStream:
        await start_checked(self.consumer, self.bootstrap_servers)
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.consumer.stop()

    def want(self, request_id: str) -> None:
        if self._wanted is not None:
            self._wanted.add(request_id.encode())

    async def existing(self, names: Iterable[str]) -> set[str]:
        """Which of these topics exist (metadata fetched afresh)."""
        # aiokafka's public API only reports partitions of subscribed topics; this client is not
        # subscribed, so it keeps the metadata of a full fetch for `seek`.
        self._cluster = await self.consumer._client.fetch_all_metadata()
        return set(names) & self._cluster.topics()

    async def wait_for_topics(
        self, notice: Callable[[list[str]], None] | None = None, optional: Iterable[str] = ()
    ) -> None:
        """Wait until every (non-optional) topic exists; optional ones that do not are dropped."""
        optional = set(optional)
        told = False
        while True:
            missing = [t for t in self.topics if t not in await self.existing(self.topics)]
            if not set(missing) - optional:
                self.topics = [t for t in self.topics if t not in missing]
                return
            if notice and not told:
                notice([t for t in missing if t not in optional])
                told = True
            await asyncio.sleep(1.0)

    async def _partitions(self) -> list[TopicPartition]:
        await self.existing(self.topics)
        return [
            TopicPartition(topic, p)
            for topic in self.topics
            for p in sorted(self._cluster.partitions_for_topic(topic) or ())
        ]

    async def seek(self, where: str | float) -> None:
        """Assign every partition and position it at ``"end"``, ``"beginning"`` or a unix time
        (the first record at or after it). Positions are resolved before this returns, so a
        request published afterwards cannot be missed."""
        tps = await self._partitions()
        self.consumer.assign(tps)
        if where == "end":
            offsets = await self.consumer.end_offsets(tps)
        elif where == "beginning":
            offsets = await self.consumer.beginning_offsets(tps)
        else:
            ends = await self.consumer.end_offsets(tps)
            found = await self.consumer.offsets_for_times(
                {tp: int(float(where) * 1000) for tp in tps}
            )
            offsets = {tp: found[tp].offset if found.get(tp) else ends[tp] for tp in tps}
        for tp in tps:
            self.consumer.seek(tp, offsets[tp])

    async def poll(self, timeout: float = 0.2) -> list[Received]:
        out = []
        batches = await self.consumer.getmany(timeout_ms=int(timeout * 1000))
        for tp, records in batches.items():
            for record in records:
                if self._wanted is not None and record.key not in self._wanted:
                    continue
                received = self._decode(tp.topic, record.value)
                if received is None:
                    continue
                event = received.event
                if (
                    self._wanted is not None
                    and (event.request_id or "").encode() not in self._wanted
                ):
                    continue
                if (
                    event.seq is not None
                    and event.request_id is not None
                    and not self._first(event.request_id, event.seq)
                ):
                    continue
                out.append(received)
        return out

    def _first(self, rid: str, seq: int) -> bool:
        """Whether this (request_id, seq) is new. A request's events arrive in seq order (one key,
        one partition), and a replay starts again from 0, so the next expected seq per request is
        all there is to remember; the oldest requests are forgotten beyond MAX_TRACKED."""
        expected = self._next_seq.get(rid, 0)
        if seq < expected:
            return False  # sent again after a crash or rebalance
        self._next_seq[rid] = seq + 1
        self._next_seq.move_to_end(rid)
        if len(self._next_seq) > self.MAX_TRACKED:
            self._next_seq.popitem(last=False)
        return True

    def _decode(self, topic: str, value: bytes | None) -> Received | None:
        try:
            raw = json.loads(value or b"")
            return Received(topic, decode_event(value or b""), raw)
        except UnknownEventType:
            pass  # a newer pipeline's event type: skip it
        except ValueError as exc:
            log.warning("skipping an undecodable record on %s: %s", topic, exc)
        self.skipped += 1
        return None


# --- printing ---------------------------------------------------------------------------------


def ms(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    return f"{seconds * 1000:.0f} ms" if seconds < 10 else f"{seconds:.1f} s"


def final_summary(event: FinalEvent) -> str:
    u, t = event.usage, event.timings
    return (
        f"{event.finish_reason}: {u.completion_tokens} tokens; prompt {u.prompt_tokens} "
        f"({u.cached_tokens} cached); TTFT {ms(t.ttft_s)}, TPOT {ms(t.tpot_s)}, "
        f"total {ms(t.total_s)}"
    )


def calls_text(event: TokenEvent) -> str:
    """The tool calls a token event completed, a line each."""
    return "".join(
        f"[tool call {c.id}: {c.function.name}({c.function.arguments})]\n"
        for c in event.tool_calls or []
    )


def error_line(event: ErrorEvent) -> str:
    who = f"request {event.request_id}" if event.request_id else "a message with no request id"
    return f"error: {who}: {event.code}: {event.message}"


class Renderer:
    """Prints what an EventStream delivers."""

    def __init__(self, out: TextIO | None = None, err: TextIO | None = None):
        self.out = out or sys.stdout
        self.err = err or sys.stderr
        self.errors = 0

    def __call__(self, received: Received) -> None:
        raise NotImplementedError

    def _error(self, event: ErrorEvent) -> None:
        self.errors += 1
        print(error_line(event), file=self.err, flush=True)


class JsonLines(Renderer):
    """Each event as one JSON line, as sent (unknown fields included); errors also on stderr."""

    def __call__(self, received: Received) -> None:
        print(json.dumps(received.raw, ensure_ascii=False), file=self.out, flush=True)
        if isinstance(received.event, ErrorEvent):
            self._error(received.event)


class Grouped(Renderer):
    """Named requests one after another: the one on screen streams live, later ones are buffered
    until their turn, so several streams never interleave. A single request prints as raw text
    then its summary line; several get a header each. ``add`` appends a request later on."""

    def __init__(
        self,
        request_ids: Iterable[str] = (),
        labels: dict[str, str] | None = None,
        out: TextIO | None = None,
        err: TextIO | None = None,
        headers: bool | None = None,
    ):
        super().__init__(out, err)
        self.order: list[str] = []
        self.labels = dict(labels or {})
        self.buffers: dict[str, list[str]] = {}
        self.ended: dict[str, Received] = {}
        self.finals: dict[str, FinalEvent] = {}
        self.current = 0
        self._headers = headers
        self._at_line_start = True
        for rid in request_ids:
            self.order.append(rid)
            self.buffers.setdefault(rid, [])
        if self.order:
            self._show(0)

    @property
    def headers(self) -> bool:
        return self._headers if self._headers is not None else len(self.order) > 1

    def add(self, request_id: str, label: str | None = None) -> None:
        if label:
            self.labels[request_id] = label
        self.order.append(request_id)
        self.buffers.setdefault(request_id, [])
        if self.current == len(self.order) - 1:
            self._show(self.current)

    def __call__(self, received: Received) -> None:
        rid = received.event.request_id
        if rid not in self.buffers:
            return
        event = received.event
        if not isinstance(event, TokenEvent):  # terminal: a final or an error event
            self.ended[rid] = received
            if isinstance(event, FinalEvent):
                self.finals[rid] = event
        elif event.index == 0:  # with n > 1 the final event lists every completion
            self.buffers[rid].append(event.text + calls_text(event))
        if self.current < len(self.order) and self.order[self.current] == rid:
            self._show(self.current, header=False)

    def _write(self, text: str) -> None:
        if text:
            self.out.write(text)
            self._at_line_start = text.endswith("\n")

    def _show(self, index: int, header: bool = True) -> None:
        """Print the request at `index` as far as it has arrived; move on while requests are
        done."""
        while index < len(self.order):
            rid = self.order[index]
            if header and self.headers:
                label = self.labels.get(rid)
                self._write(f"--- {rid}{': ' + label if label else ''}\n")
            self._write("".join(self.buffers[rid]))
            self.buffers[rid].clear()
            self.out.flush()
            if rid not in self.ended:
                return
            event = self.ended[rid].event
            if not self._at_line_start:
                self._write("\n")
            if isinstance(event, FinalEvent):
                self._write(f"[{final_summary(event)}]\n")
                self.out.flush()
            else:
                assert isinstance(event, ErrorEvent)  # `ended` holds terminal events only
                self._write(f"[error: {event.code}]\n")
                self.out.flush()
                self._error(event)
            index += 1
            self.current = index
            header = True


class Prefixed(Renderer):
    """Any number of requests as they come, as a log: each line starts with ``[id]``. A request's
    text is printed a line at a time (wrapped at about `width` characters), so concurrent streams
    stay readable; the rest and a summary line follow its final event."""

    def __init__(self, out: TextIO | None = None, err: TextIO | None = None, width: int = 80):
        super().__init__(out, err)
        self.width = width
        self.pending: dict[str, str] = {}

    @staticmethod
    def short(rid: str) -> str:
        return rid if len(rid) <= 12 else rid[:8]

    def __call__(self, received: Received) -> None:
        event = received.event
        if isinstance(event, ErrorEvent):
            self.pending.pop(event.request_id or "", None)
            self.out.flush()
            self._error(event)
            return
        rid = event.request_id
        prefix = f"[{self.short(rid)}] "
        if isinstance(event, TokenEvent):
            if event.index:
                return  # with n > 1: completion 0 only (the final event lists every completion)
            text = self.pending.get(rid, "") + event.text + calls_text(event)
            *lines, rest = text.split("\n")
            while len(rest) > self.width:
                cut = rest.rfind(" ", 0, self.width) + 1 or self.width
                lines.append(rest[:cut].rstrip())
                rest = rest[cut:]
            self.pending[rid] = rest
        else:
            rest = self.pending.pop(rid, "")
            lines = ([rest] if rest else []) + [f"[{final_summary(event)}]"]
        for line in lines:
            self.out.write(f"{prefix}{line}\n")
        self.out.flush()


async def follow(
    stream: EventStream,
    render: Callable[[Received], None],
    request_ids: Iterable[str] | None,
    timeout: float | None = None,
) -> set[str]:
    """Feed the stream to `render` until every named request has a final or error event (forever
    when `request_ids` is None). Returns the ids still unfinished when `timeout` ran out."""
    pending = None if request_ids is None else set(request_ids)
    deadline = None if timeout is None else time.monotonic() + timeout
    while pending is None or pending:
        if deadline is not None and time.monotonic() > deadline:
            return pending or set()
        for received in await stream.poll():
            render(received)
            if received.terminal and pending is not None:
                pending.discard(received.event.request_id)
    return set()


def run_async(main: Coroutine[Any, Any, int], command: str, interrupted: int = EXIT_OK) -> int:
    """Run a command's coroutine: a ClientError is one line on stderr (exit 2), Ctrl-C exits with
    `interrupted`, and a closed stdout (`| head`) ends the command quietly."""
    try:
        return asyncio.run(main)
    except (ClientError, KafkaRefused, KafkaSecurityError) as exc:
        print(f"sluice {command}: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return interrupted
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit
        return EXIT_FAILED


def parse_since(text: str) -> float:
    """`--since`: seconds or a duration with a unit (90s, 10m, 2h, 1d) ago, as a unix time."""
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    try:
        if text[-1:] in units:
            seconds = float(text[:-1]) * units[text[-1]]
        else:
            seconds = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"not a duration: {text!r} (use e.g. 90, 10m, 2h)"
        ) from None
    return time.time() - seconds


class StdinLines:
    """Lines of stdin delivered to the event loop by a daemon thread, so a blocking read never
    holds up Kafka and Ctrl-C or exit never waits for it. None marks EOF."""

    def __init__(self, stream: TextIO | None = None):
        self.queue: asyncio.Queue[str | None] = asyncio.Queue()
        self._loop = asyncio.get_running_loop()
        self._stream = stream or sys.stdin
        threading.Thread(target=self._read, name="stdin", daemon=True).start()

    def _read(self) -> None:
        try:
            for line in self._stream:
                self._put(line)
        finally:
            self._put(None)

    def _put(self, item: str | None) -> None:
        try:
            self._loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the loop is closed: the command is exiting
            pass

    async def get(self) -> str | None:
        return await self.queue.get()
