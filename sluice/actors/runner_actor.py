"""Runner actor: owns one engine and turns its steps into an ordered stream of step messages.

The engine's step loop runs in a thread of its own (`EngineLoop` in a `ThreadedWorker`), the only
thread that touches the engine, so the event loop keeps serving Kafka heartbeats and polls while a
step computes. This actor lives on the event loop: it hands requests to the thread, tracks them,
and builds a message from each step result. Sequence numbers are given here, in the order the
engine produced the tokens.

With a progress log (`progress.py`) every step's messages are recorded before they are handed on,
and a request delivered again (after a crash, a restart, a rebalance) is resumed from its record:
its recorded messages are sent again as they were, and the engine continues after its recorded
tokens with its recorded seed, so no (request_id, seq) is ever sent with another content.

A prefill runner (`handoff`) serves a request only up to its first token, then passes it on to a
decode runner with its prompt's KV (`kv_handoff.py`); any runner continues a request passed to it
as it resumes one.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from dataclasses import dataclass, field

from sluice.actors.conversation import remembered_turn
from sluice.actors.delivery import Delivery
from sluice.actors.engine_loop import Admission, EngineLoop, Rejection, SnapshotWanted, StepResult
from sluice.actors.errors import error_step, wire_code
from sluice.actors.kv_events import KvEventPublisher, RunnerLoad
from sluice.actors.kv_handoff import KvFiles, PrefillHandoff
from sluice.actors.messages import Envelope, RequestHandle, StepMessage, TokenizedRequest
from sluice.actors.metrics import Metrics
from sluice.actors.output_reader import OutputReader
from sluice.actors.progress import Progress, ProgressLog, RecordedTokens, request_digest
from sluice.actors.runtime import Actor, ThreadedWorker, WorkerStopped
from sluice.actors.scheduler_actor import routing_key
from sluice.actors.transport import Sink
from sluice.engine import LLMEngine, StepOutput
from sluice.engine.draws import new_seed
from sluice.engine.errors import TensorParallelError
from sluice.schemas.events import Provenance, Timings, TokenLogprob, TopLogprob, Usage

log = logging.getLogger(__name__)

RESTARTED = "the runner restarted while serving this request"


def client_clock_start(work: TokenizedRequest) -> float:
    """When the client's wait began: the request's publish (its record's timestamp), or when it
    was read when the record had none. A publisher's clock ahead of ours cannot make it later
    than the read."""
    if work.published_at is None:
        return work.received_at
    return min(work.published_at, work.received_at)


def in_topic(work: TokenizedRequest) -> float | None:
    """How long the request waited in its topic before the pipeline read it."""
    if work.published_at is None:
        return None
    return work.received_at - client_clock_start(work)


def token_text(raw: bytes) -> str:
    """A token's bytes as text; a piece of a character is written as OpenAI writes it,
    'bytes:' and the bytes escaped (b'\\xe2\\x80' -> 'bytes:\\xe2\\x80')."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


@dataclass
class _Tracked:
    work: TokenizedRequest
    delivery: Delivery  # of its input record: done with its final message
    handle: RequestHandle  # what its step messages tell the streamer of it
    submitted_at: float  # wall clock, when handed to the engine thread
    seq: int = 0
    texts: dict[int, str] = field(default_factory=dict)
    token_ids: dict[int, list[int]] = field(default_factory=dict)
    finals: dict[int, StepOutput] = field(default_factory=dict)
    expired: bool = False  # aborted at its deadline
    record: Progress | None = None  # what the progress log holds of it (with a progress log)
    # Every logprob entry, per completion, when its one event must carry them (no streaming).
    logprobs: dict[int, list[TokenLogprob]] | None = None
    passing_on: bool = False  # admitted to be passed on to a decode runner after its first token
    # with tools or a reasoning parser: reads its completions' reasoning, content and calls
    reader: OutputReader | None = None


# A message a step sends, with its delivery and the request it is about.
_Outgoing = tuple[StepMessage, Delivery, _Tracked]


class RunnerActor(Actor):
    # A tensor-parallel rank is gone: no restart in this process brings it back, so the process
    # exits and whoever started it starts it again (the requests resume from their records).
    fatal = (TensorParallelError,)

    def __init__(
        self,
        engine: LLMEngine,
        send_steps: Sink,
        *,
        runner_id: str = "runner-0",
        max_queue: int = 256,
        metrics: Metrics | None = None,
        progress: ProgressLog | None = None,
        max_crashes: int = 5,
        name: str | None = None,
        kv_events: KvEventPublisher | None = None,
        handoff: PrefillHandoff | None = None,
        kv_files: KvFiles | None = None,
    ):
        super().__init__(name or runner_id, capacity=max_queue)
        self.kv_events = kv_events  # with a router: where the prefix cache's changes go
        self._snapshot_asked = False
        self.handoff = handoff  # a prefill runner's way to pass requests on
        self.kv_files = kv_files  # where KV passed to this runner waits
        self._passing: list[_Tracked] = []  # got their first token this step: to pass on
        self.engine = engine
        self.send_steps = send_steps
        self.progress = progress
        self.max_crashes = max_crashes
        self.runner_id = runner_id
        self.max_queue = max_queue
        self.metrics = metrics
        self.model_id = engine.model_id.rsplit("/", 1)[-1]
        self._tokenizer = getattr(engine, "tokenizer", None)  # test engines may have none
        provenance = getattr(engine, "provenance", None)  # test engines may have none
        self.provenance = Provenance(**provenance.to_dict()) if provenance is not None else None
        self._tracked: dict[str, _Tracked] = {}
        self._readmit: list[_Tracked] = []  # after a restart, to admit again
        self._suspects: deque[Admission] = deque()  # waiting to be admitted alone
        self._probing: str | None = None  # the suspect admitted last
        self._worker: ThreadedWorker | None = None
        self.peak_queue = 0  # most requests the engine held at once (bounded by max_queue)
        if metrics:
            metrics.runner_queue_bound.labels(runner_id).set(max_queue)
            metrics.runner_peak_queue.labels(runner_id).set(0)

    async def on_start(self) -> None:
        if self.kv_events is not None:
            self.engine.record_kv_events()  # (the engine thread is not running yet)
        loop = EngineLoop(self.engine)
        self._worker = ThreadedWorker(
            step=loop.step,
            accept=loop.accept,
            has_work=loop.has_work,
            name=self.runner_id,
            max_pending=16,
            on_start=getattr(self.engine, "bind_thread", None),  # (test engines may have none)
        )
        self._worker.start()
        self.spawn(self._pump(), name=f"{self.runner_id}-pump")
        if self.kv_events is not None:
            self._snapshot_asked = False  # (a restart lost the one asked for)
            self.spawn(self._report_kv(), name=f"{self.runner_id}-kv-events")
        readmit, self._readmit = self._readmit, []
        for tracked in readmit:
            if tracked.record is None:
                self._tracked.pop(tracked.work.request.request_id, None)
                failed = self._failed(tracked, RESTARTED)
                await self.send_steps(Envelope(failed, tracked.delivery))
            else:
                record = tracked.record
                self._worker.submit(Admission(tracked.work, record.seed, record.resume()))

    async def on_stop(self) -> None:
        if self._worker is not None:
            await self._worker.stop(drain=False)

    async def on_restart(self, exc: BaseException) -> None:
        """After a crash (the engine thread failed): what the engine held is dropped, and every
        request this actor tracks is admitted again when the new engine thread starts: resumed
        from its progress record, or, without a progress log, failed with an error final."""
        self.engine.reset()
        self._readmit = list(self._tracked.values())
        log.warning(
            "runner restarted after %s: taking up its %d request(s) again",
            type(exc).__name__,
            len(self._readmit),
        )

    async def handle(self, envelope: Envelope[TokenizedRequest]) -> None:
        work: TokenizedRequest = envelope.body
        request_id = work.request.request_id
        if request_id in self._tracked:
            # Redelivered while the first copy still runs (e.g. a rebalance): one copy is enough,
            # and the copy is done when the first one is (`Delivery.also`).
            log.warning("request %s is already running here; dropping the duplicate", request_id)
            self._tracked[request_id].delivery.also(envelope.delivery)
            return
        if self.progress is not None and (work.taken_over_from or work.handoff):
            # Its first runner died, or passed it on: read what that runner recorded since this
            # one last looked.
            await self.progress.catch_up()
        record = self.progress.get(work.request) if self.progress is not None else None
        passed_before = record is not None and record.handed_to is not None and not record.final
        if passed_before and work.handoff is None and self.handoff is not None:
            assert record is not None
            if await self._pass_on_again(work, record, envelope):
                return
        if record is not None:
            record.origin = envelope.delivery.origin
        if record is not None and record.final is not None:
            if self.progress is not None and self.progress.transactional:
                # Its events and its final are committed, and visible; its offset is not, and
                # its session turn may not be recorded yet: the streamer finishes it, publishing
                # nothing.
                log.info("request %s delivered again after its final: finishing it", request_id)
                published = record.final.model_copy(update={"published": True})
                await self.send_steps(envelope.derive(published))
                return
            # It had finished: send everything again as it was, and nothing else.
            log.info("request %s delivered again after its final: resending it", request_id)
            await self._resend(work, record, envelope.delivery)
            await self.send_steps(envelope.derive(record.final))
            return
        request = work.request
        kv = None
        handoff = work.handoff
        if handoff is not None and handoff.kv_file and self.kv_files is not None:
            kv = await asyncio.to_thread(self.kv_files.take, handoff.kv_file, handoff.kv_source)
        tracked = _Tracked(work, envelope.delivery, self._handle(work), time.time())
        tracked.reader = OutputReader.for_request(request, self._tokenizer)
        if not request.stream and request.logprobs is not None:
            tracked.logprobs = {}
        resume = None
        if record is not None:
            log.info(
                "request %s resumes after its %d published token message(s)",
                request_id,
                len(record.tokens),
            )
            if not (self.progress is not None and self.progress.transactional):
                # What a client may have read, and more: sent again as it was. (Exactly-once:
                # what the record holds is exactly what is visible; nothing to send again.)
                await self._resend(work, record, envelope.delivery)
            tracked.seq = record.next_seq
            tracked.texts = record.texts()
            if tracked.logprobs is not None:
                for tokens in record.tokens:
                    tracked.logprobs.setdefault(tokens.index, []).extend(tokens.logprobs or [])
            tracked.token_ids = record.resume()
            resume = record.resume()
            record.delivered_again()
        else:
            seed = request.seed if request.seed is not None else new_seed()
            record = Progress(request_id=request_id, digest=request_digest(request), seed=seed)
            record.origin = envelope.delivery.origin
        if self.progress is not None:
            tracked.record = record
        self._tracked[request_id] = tracked
        self.peak_queue = max(self.peak_queue, len(self._tracked))
        if self.metrics:
            self.metrics.queue_depth.labels("runner").set(len(self._tracked))
            self.metrics.runner_peak_queue.labels(self.runner_id).set(self.peak_queue)
        tracked.passing_on = (
            self.handoff is not None
            and self.progress is not None
            and work.handoff is None
            and request.n == 1
            and request.max_tokens > 1
            and not record.tokens
            and self.handoff.available()
        )
        admission = Admission(work, record.seed, resume, prefill_only=tracked.passing_on, kv=kv)
        if self.progress is None:
            assert self._worker is not None  # made in on_start, before any message is handled
            self._worker.submit(admission)
        elif record.crashes >= self.max_crashes:
            await self._dead_letter(tracked)
        elif record.crashes:
            # It was in the engine when the process stopped, and got no further: a suspect. Run
            # suspects one at a time, so the one that stops the process is the one counted.
            log.warning(
                "request %s was being served when the process stopped (%d time(s) in a "
                "row without getting further): admitted alone",
                request_id,
                record.crashes,
            )
            self._suspects.append(admission)
            self._next_suspect()
        else:
            self.spawn(self._admit(admission, record), name=f"admit-{request_id}")

    async def _admit(self, admission: Admission, record: Progress) -> None:
        """Record the new stint before the engine sees the request (so a request that crashes
        the process is known to have been in the engine), then hand it over."""
        assert self.progress is not None and self._worker is not None
        record.admitted()
        await self.progress.save([record])
        if admission.work.request.request_id in self._tracked:
            self._worker.submit(admission)

    def _next_suspect(self) -> None:
        """Admit the next suspect once the one admitted before it got further (or ended)."""
        if self._probing is not None and self._probing in self._tracked:
            probe = self._tracked[self._probing]
            if probe.record is None or probe.seq == probe.record.seq_at_admission:
                return  # still no further
        self._probing = None
        while self._suspects:
            admission = self._suspects.popleft()
            tracked = self._tracked.get(admission.work.request.request_id)
            if tracked is None or tracked.record is None:
                continue
            self._probing = admission.work.request.request_id
            self.spawn(self._admit(admission, tracked.record), name=f"admit-{self._probing}")
            return

    async def _dead_letter(self, tracked: _Tracked) -> None:
        """A request that was being served each time the process stopped, `max_crashes` times
        without getting further: it ends with an error (and goes to the dead-letter topic)."""
        record = tracked.record
        assert record is not None and self.progress is not None
        self._tracked.pop(record.request_id, None)
        why = (
            f"dead-lettered: the pipeline stopped {record.crashes} times while "
            "serving this request, without it getting further"
        )
        log.error("request %s %s", record.request_id, why)
        raw = tracked.work.request.model_dump_json(exclude_none=True)
        message = self._failed(tracked, why).model_copy(update={"dead_letter": raw})
        record.finish(message)
        writes = []
        if self.progress.transactional:
            writes = self.progress.stage(record)
        else:
            await self.progress.save([record])
        await self.send_steps(Envelope(message, tracked.delivery, writes))

    def _failed(self, tracked: _Tracked, why: str) -> StepMessage:
        """A final with finish_reason "error" after what the request had published."""
        texts = tracked.texts
        content = reasoning = calls = None
        if tracked.reader is not None:  # (what was sent, less its calls, as any final says)
            read = tracked.reader.ended(0, texts.get(0, ""))
            content, reasoning, calls = read.content, read.reasoning or None, read.calls or None
        return StepMessage(
            seq=tracked.seq,
            finished=True,
            finish_reason="error",
            failure=why,
            usage=Usage(
                prompt_tokens=len(tracked.work.prompt_token_ids),
                cached_tokens=0,
                completion_tokens=sum(len(ids) for ids in tracked.token_ids.values()),
            ),
            timings=Timings(
                queue_s=0.0,
                ttft_s=None,
                tpot_s=None,
                total_s=max(0.0, time.time() - client_clock_start(tracked.work)),
                in_topic_s=in_topic(tracked.work),
            ),
            full_text=texts.get(0, ""),
            content=content,
            reasoning=reasoning,
            tool_calls=calls,
            seed=tracked.record.seed if tracked.record else None,
            request_id=tracked.work.request.request_id,
            request=tracked.handle,
        )

    async def _resend(self, work: TokenizedRequest, record: Progress, delivery: Delivery) -> None:
        """The token messages recorded for this request, sent again as they were."""
        handle = self._handle(work)
        positions: dict[int, int] = {}
        for tokens in record.tokens:
            position = positions.get(tokens.index, 0)
            positions[tokens.index] = position + len(tokens.token_ids)
            message = StepMessage(
                seq=tokens.seq,
                index=tokens.index,
                position=position,
                token_ids=tokens.token_ids,
                text=tokens.text,
                logprobs=tokens.logprobs,
                content=tokens.content,
                tool_calls=tokens.tool_calls,
                request_id=work.request.request_id,
                request=handle,
            )
            await self.send_steps(Envelope(message, delivery.for_part()))

    async def _pump(self) -> None:
        assert self._worker is not None  # on_start made it before spawning this
        async for result in self._worker:
            messages = self._messages(result)
            writes: list[list] = [[] for _ in messages]
            if self.progress is not None:
                writes = await self._record(messages)
            for (message, delivery, tracked), with_it in zip(messages, writes):
                if tracked.passing_on:
                    continue  # its first token: the decode runner sends it (held back here)
                await self.send_steps(Envelope(message, delivery, with_it))
            passing, self._passing = self._passing, []
            for tracked in passing:
                await self._pass_on(tracked, result.kv_exports.get(tracked.work.request.request_id))
            if self._probing is not None:
                self._next_suspect()
            if self.kv_events is not None:
                if result.kv_snapshot is not None:
                    self._snapshot_asked = False
                    await self.kv_events.snapshot(result.kv_snapshot, self.load())
                else:
                    await self.kv_events.changes(result.kv_events, self.load())
            if self.metrics:
                self._observe()

    async def _pass_on(self, tracked: _Tracked, kv) -> None:
        """Pass a request that got its first token on to a decode runner (its token recorded and
        held back); with none alive, serve the rest of it here."""
        assert self.handoff is not None and self.progress is not None
        work, record = tracked.work, tracked.record
        assert record is not None
        rid, key = work.request.request_id, routing_key(work)
        choice = self.handoff.target(work, key)
        if choice is None:
            log.warning("no decode runner alive: request %s is served here", rid)
            tracked.passing_on = False
            self._tracked[rid] = tracked
            await self._resend(work, record, tracked.delivery)  # the first token, held back
            assert self._worker is not None
            self._worker.submit(Admission(work, record.seed, record.resume()))
            return
        # Recorded first: delivered here again after a crash, it is passed on again, never
        # served by two runners at once.
        record.handed_to = choice.runner_id
        record.header_saved = False
        await self.progress.save([record])
        self.progress.handed_over.add(rid)
        await self.handoff.send(work, key, choice, kv)
        log.debug("request %s passed on to runner %s", rid, choice.runner_id)
        tracked.delivery.done()

    async def _pass_on_again(self, work: TokenizedRequest, record: Progress, envelope) -> bool:
        """A request this runner had passed on, delivered again (this runner restarted before its
        input was committed): passed on again, to the same decode runner while it lives, rather
        than served twice. False when no decode runner is alive (it is then served here)."""
        assert self.handoff is not None and self.progress is not None
        choice = self.handoff.target(work, routing_key(work), prefer=record.handed_to)
        if choice is None:
            return False
        self.progress.handed_over.add(work.request.request_id)
        await self.handoff.send(work, routing_key(work), choice, None)
        log.info(
            "request %s delivered again: passed on to runner %s again",
            work.request.request_id,
            choice.runner_id,
        )
        envelope.delivery.done()
        return True

    async def _report_kv(self) -> None:
        """Heartbeats with the runner's load, and now and then every block it holds."""
        publisher = self.kv_events
        assert publisher is not None and self._worker is not None
        while True:
            if publisher.snapshot_due() and not self._snapshot_asked:
                self._snapshot_asked = True
                try:
                    self._worker.submit(SnapshotWanted())  # the engine thread lists them
                except WorkerStopped:
                    return  # stopping
            elif publisher.heartbeat_due():
                await publisher.heartbeat(self.load())
            await asyncio.sleep(publisher.heartbeat_s / 4)

    def load(self) -> RunnerLoad:
        """What this runner holds, for the router (plain reads: a slightly stale value is fine)."""
        stats = self.engine.stats()
        return RunnerLoad(
            running=len(self._tracked),
            waiting=int(stats["num_waiting"]),
            free_blocks=int(stats["num_free_kv_blocks"]),
            num_blocks=int(stats["num_kv_blocks"]),
        )

    async def _record(self, messages: list[_Outgoing]) -> list[list]:
        """Add the step's messages to their requests' records and write them, before any of the
        messages goes out: a record holds at least what a client may have read. Exactly-once: the
        records go out with their message instead, in one piece of its partition's transaction
        (returned per message), so records and events commit together."""
        assert self.progress is not None
        changed: dict[str, Progress] = {}
        writes: list[list] = [[] for _ in messages]
        for i, (message, _, tracked) in enumerate(messages):
            record = tracked.record
            if record is None:
                continue
            if message.finished:
                record.finish(message)
            else:
                record.add_tokens(
                    RecordedTokens(
                        seq=message.seq,
                        index=message.index,
                        token_ids=message.token_ids,
                        text=message.text,
                        logprobs=message.logprobs,
                        content=message.content,
                        tool_calls=message.tool_calls,
                    )
                )
            if self.progress.transactional:
                writes[i] = self.progress.stage(record)
            else:
                changed[record.request_id] = record
        if changed:
            await self.progress.save(list(changed.values()))
        return writes

    def _observe(self) -> None:
        assert self.metrics is not None  # called only when there are metrics
        stats = self.engine.stats()  # plain reads of counters; a slightly stale value is fine
        self.metrics.kv_cache_usage.labels(self.runner_id).set(stats["kv_cache_usage"])
        self.metrics.prefix_hit_rate.labels(self.runner_id).set(stats["prefix_cache_hit_rate"])
        self.metrics.preemptions.labels(self.runner_id).set(stats["num_preemptions"])
        self.metrics.kv_pinned_blocks.labels(self.runner_id).set(stats["num_pinned_kv_blocks"])
        self.metrics.queue_depth.labels("runner").set(len(self._tracked))

    # -- step results -> messages --------------------------------------------------------------

    def _messages(self, result: StepResult) -> list[_Outgoing]:
        """What a step's results send, each with its delivery: the input's on a request's last
        message, a part of it on the others."""
        messages: list[_Outgoing] = []
        for rejection in result.rejections:
            messages += self._rejection(rejection)
        for request_id in result.expired:
            if request_id in self._tracked:
                self._tracked[request_id].expired = True
        for out in result.outputs:
            tracked = self._tracked.get(out.request_id)
            if tracked is None:
                continue
            message = self._token_message(tracked, out)
            if message is not None:
                messages.append((message, tracked.delivery.for_part(), tracked))
                if tracked.logprobs is not None and message.logprobs:
                    tracked.logprobs.setdefault(out.index, []).extend(message.logprobs)
            tracked.texts[out.index] = tracked.texts.get(out.index, "") + out.text
            tracked.token_ids.setdefault(out.index, []).extend(out.new_token_ids)
            if out.finished and tracked.passing_on and out.finish_reason == "length":
                del self._tracked[out.request_id]  # its first token: on to a decode runner
                self._passing.append(tracked)
                if self.metrics:
                    self.metrics.runner_passed_on.labels(self.runner_id).inc()
                continue
            if tracked.passing_on:
                tracked.passing_on = False  # finished at its first token: served here after all
            if out.finished:
                tracked.finals[out.index] = out
                if len(tracked.finals) == tracked.work.request.n:
                    del self._tracked[out.request_id]
                    messages.append((self._final_message(tracked), tracked.delivery, tracked))
                    if self.metrics:
                        self.metrics.runner_finished.labels(self.runner_id).inc()
        return messages

    def _rejection(self, rejection: Rejection) -> list[_Outgoing]:
        tracked = self._tracked.pop(rejection.request_id, None)
        if tracked is None:
            return []
        exc = rejection.error
        message = error_step(tracked.work.request, wire_code(exc), str(exc), exc.field)
        return [(message.model_copy(update={"seq": tracked.seq}), tracked.delivery, tracked)]

    def _spelling(self, token_id: int) -> dict:
        """A token's text and bytes, for its logprob entry (none from a model without a
        tokenizer)."""
        if self._tokenizer is None:
            return {}
        table = self._tokenizer.token_bytes  # (made once, on first use)
        if token_id >= len(table):
            return {}
        raw = table[token_id]
        return {"token": token_text(raw), "bytes": list(raw)}

    def _handle(self, work: TokenizedRequest) -> RequestHandle:
        request = work.request
        return RequestHandle(
            reply_topic=request.reply_topic,
            session_id=request.session_id,
            tenant=request.tenant,
            metadata=request.metadata,
            model=self.model_id,
            runner_id=self.runner_id,
            stream=request.stream,
            event_format=request.event_format,
            chat=request.is_chat,
            created=int(work.published_at or work.received_at),
        )

    def _token_message(self, tracked: _Tracked, out: StepOutput) -> StepMessage | None:
        """The message of a step's new tokens; None when there is nothing to send."""
        content = reasoning = calls = None
        if tracked.reader is not None:  # (its last output may release text held back, or a call)
            before = tracked.texts.get(out.index, "")
            # A prefill runner's one token "finishes" only here: a decode runner goes on with it.
            handed_on = tracked.passing_on and out.finish_reason == "length"
            ended = out.finished and not handed_on
            read = tracked.reader.step(out.index, before, out.text, ended)
            content, reasoning, calls = read.content, read.reasoning, read.calls
            if not (out.new_token_ids or content or reasoning or calls):
                return None
        elif not (out.new_token_ids or out.text):
            return None
        logprobs = None
        if out.logprobs:
            spell = self._spelling
            logprobs = [
                TokenLogprob(
                    token_id=lp.token_id,
                    logprob=lp.logprob,
                    **spell(lp.token_id),
                    top=[TopLogprob(token_id=t, logprob=v, **spell(t)) for t, v in lp.top],
                )
                for lp in out.logprobs
            ]
        message = StepMessage(
            seq=tracked.seq,
            index=out.index,
            position=len(tracked.token_ids.get(out.index, [])),
            token_ids=out.new_token_ids,
            text=out.text,
            logprobs=logprobs,
            content=content,
            reasoning=reasoning or None,
            tool_calls=calls or None,
            request_id=tracked.work.request.request_id,
            request=tracked.handle,
        )
        tracked.seq += 1
        return message

    def _final_message(self, tracked: _Tracked) -> StepMessage:
        request = tracked.work.request
        first = tracked.finals[0]
        last_usage = max(
            (o.usage for o in tracked.finals.values()), key=lambda u: u.completion_tokens
        )
        # Engine timings start when the engine got the request; the client's clock started when
        # it published the request.
        started = client_clock_start(tracked.work)
        before_engine = max(0.0, tracked.submitted_at - started)
        t = first.timings

        def shifted(value: float | None) -> float | None:
            return None if value is None else value + before_engine

        timings = Timings(
            queue_s=shifted(t.queue_s) or before_engine,
            ttft_s=shifted(t.ttft_s),
            tpot_s=t.tpot_s,
            total_s=max(0.0, time.time() - started),
            in_topic_s=in_topic(tracked.work),
        )
        usage = Usage(
            prompt_tokens=last_usage.prompt_tokens,
            cached_tokens=last_usage.cached_tokens,
            completion_tokens=sum(len(ids) for ids in tracked.token_ids.values()),
        )
        endings = {i: self._ending(tracked, i, o) for i, o in tracked.finals.items()}
        choices = None
        if request.n > 1:
            choices = [
                dict(
                    index=i,
                    text=endings[i][0],
                    finish_reason=endings[i][2],
                    stop_reason=o.stop_reason,
                    completion_tokens=len(tracked.token_ids.get(i, [])),
                    tool_calls=endings[i][1],
                    reasoning=endings[i][3],
                )
                for i, o in sorted(tracked.finals.items())
            ]
        session_messages = session_ids = None
        if request.session_id is not None and first.finish_reason != "error":
            session_messages, session_ids = remembered_turn(
                tracked.work, tracked.texts.get(0, ""), tracked.token_ids.get(0, [])
            )
        message = StepMessage(
            seq=tracked.seq,
            finished=True,
            finish_reason=endings[0][2],
            stop_reason="deadline" if tracked.expired else first.stop_reason,
            usage=usage,
            timings=timings,
            full_text=tracked.texts.get(0, ""),
            content=endings[0][0] if tracked.reader else None,
            reasoning=endings[0][3],
            tool_calls=endings[0][1],
            choices=choices,
            choice_logprobs=tracked.logprobs,
            seed=first.seed,
            provenance=self.provenance,
            failure=next((o.error for o in tracked.finals.values() if o.error), None),
            session_messages=session_messages,
            session_token_ids=session_ids,
            session_start=(tracked.work.history_messages, tracked.work.history_tokens)
            if session_messages is not None
            else None,
            request_id=tracked.work.request.request_id,
            request=tracked.handle,
        )
        tracked.seq += 1
        return message

    @staticmethod
    def _ending(
        tracked: _Tracked, index: int, out: StepOutput
    ) -> tuple[str, list[dict] | None, str, str | None]:
        """(text, calls, finish reason, reasoning) of a finished completion: its text less its
        reasoning and calls, with a reader; one that stopped having made calls finished with
        "tool_calls", as OpenAI's do."""
        text, reason = tracked.texts.get(index, ""), out.finish_reason
        if tracked.reader is None:
            return text, None, reason, None
        read = tracked.reader.ended(index, text)
        calls = read.calls or None
        finish = "tool_calls" if calls and reason == "stop" else reason
        return read.content, calls, finish, read.reasoning or None
