"""The runner's engine thread: accept tokenized requests, step the engine, abort at deadlines.

Everything here runs on that one thread, the only one that touches the engine (`ThreadedWorker`
calls `accept`, `has_work` and `step`); what a step produced travels to the event loop as a
`StepResult`, where `RunnerActor` tracks requests and builds messages. The two share nothing else.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from sluice.actors.messages import TokenizedRequest
from sluice.actors.tool_calls import sampling_kwargs
from sluice.engine import EngineError, LLMEngine, SamplingParams, StepOutput
from sluice.engine.kv_events import KvEvents
from sluice.engine.kv_transfer import KvBlocks, export_prefix, import_prefix

log = logging.getLogger(__name__)


@dataclass
class Admission:
    """A request handed to the engine thread: its seed (the request's, or one given to it) and,
    for a request taken up again, the tokens each completion had already published. A prefill
    runner admits a request it will pass on `prefill_only` (its prompt and first token; its KV is
    exported when that is done); a decode runner adopts the prompt's `kv` first."""

    work: TokenizedRequest
    seed: int
    resume: dict[int, list[int]] | None = None
    prefill_only: bool = False
    kv: KvBlocks | None = None


@dataclass
class Rejection:
    request_id: str
    error: EngineError  # why the engine would not take it


class SnapshotWanted:
    """Handed to the engine thread for the next step result to carry every cached block."""


@dataclass
class StepResult:
    rejections: list[Rejection] = field(default_factory=list)
    outputs: list[StepOutput] = field(default_factory=list)
    # Aborted at their deadline this step; their final outputs are among `outputs`.
    expired: list[str] = field(default_factory=list)
    # How the prefix cache changed in this step (when the engine records it), and, when one was
    # wanted, every block it holds after the step (which the changes are part of).
    kv_events: KvEvents = field(default_factory=KvEvents)
    kv_snapshot: list[bytes] | None = None
    # Prefill-only requests that got their first token this step: their prompt's KV (None when
    # none of it is cached any more), to hand over with them.
    kv_exports: dict[str, KvBlocks | None] = field(default_factory=dict)


class EngineLoop:
    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self._rejections: list[Rejection] = []  # since the last step
        self._deadlines: dict[str, float] = {}  # request id -> unix deadline
        self._snapshot_wanted = False
        self._prefill_only: dict[str, TokenizedRequest] = {}

    def accept(self, admission: Admission | SnapshotWanted) -> None:
        if isinstance(admission, SnapshotWanted):
            self._snapshot_wanted = True
            return
        work = admission.work
        request = work.request
        if admission.kv is not None:
            adopted = import_prefix(self.engine, admission.kv)
            log.info(
                "request %s: %d of its prompt's %d tokens computed by runner %s adopted",
                request.request_id,
                adopted,
                len(work.prompt_token_ids),
                work.handoff.from_runner if work.handoff else "?",
            )
        tokenizer = getattr(self.engine, "tokenizer", None)  # test engines may have none
        kwargs = {**sampling_kwargs(request, tokenizer), "seed": admission.seed}
        if admission.prefill_only:
            kwargs["max_tokens"] = 1
            self._prefill_only[request.request_id] = work
        try:
            self.engine.add_request(
                request.request_id,
                prompt_token_ids=work.prompt_token_ids,
                params=SamplingParams(**kwargs),
                priority=request.priority,
                cache_salt=request.tenant,
                resume=admission.resume,
                keep_kv=(
                    (request.keep_kv.key, request.keep_kv.seconds) if request.keep_kv else None
                ),
            )
        except EngineError as exc:
            self._prefill_only.pop(request.request_id, None)
            self._rejections.append(Rejection(request.request_id, exc))
            return
        if request.deadline is not None:
            self._deadlines[request.request_id] = request.deadline

    def has_work(self) -> bool:
        return self.engine.has_unfinished() or bool(self._rejections) or self._snapshot_wanted

    def step(self) -> StepResult:
        expired = self._abort_expired()
        rejections, self._rejections = self._rejections, []
        outputs = self.engine.step() if self.engine.has_unfinished() else []
        result = StepResult(rejections, outputs, expired, self.engine.take_kv_events())
        for out in outputs:
            work = self._prefill_only.pop(out.request_id, None) if out.finished else None
            if work is not None and out.finish_reason == "length":
                # Before any later step can evict the prompt's blocks.
                ids, salt = work.prompt_token_ids, work.request.tenant
                result.kv_exports[out.request_id] = export_prefix(self.engine, ids, salt)
        if self._snapshot_wanted:
            self._snapshot_wanted = False
            result.kv_snapshot = self.engine.cached_block_hashes()
        return result

    def _abort_expired(self) -> list[str]:
        """Abort requests past their deadline: their final output (finish_reason "abort") keeps
        the tokens already produced."""
        if not self._deadlines:
            return []
        now, expired = time.time(), []
        for request_id, deadline in list(self._deadlines.items()):
            if not self.engine.has_request(request_id):
                del self._deadlines[request_id]
            elif deadline < now:
                del self._deadlines[request_id]
                expired.append(request_id)
                self.engine.abort(request_id)
                log.info("request %s passed its deadline while generating: aborted", request_id)
        return expired
