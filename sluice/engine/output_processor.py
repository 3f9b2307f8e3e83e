"""From a completion's sampled tokens to what the engine hands out (`OutputProcessor`): each new
token's text (through the completion's incremental detokenizer), its grammar state, its times and
logprobs, and whether it ends the completion, decided in one place (`OutputProcessor.ending`:
EOS, a stop token, a stop string, `max_tokens`, the model's context). A resumed completion's
earlier tokens go through the same checks (`OutputProcessor.replay`)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Set

from sluice.engine.detokenizer import IncrementalDetokenizer
from sluice.engine.errors import EngineError
from sluice.engine.outputs import StepOutput
from sluice.engine.request import Request, final_output
from sluice.engine.sampler import TokenLogprobs
from sluice.engine.sampling_params import SamplingParams
from sluice.engine.sequence import Sequence, SequenceStatus
from sluice.engine.structured import Grammars
from sluice.engine.tokenizer import Tokenizer

# (sequence, its finished status, when, its stop reason): `BatchScheduler.finish`
Finish = Callable[[Sequence, SequenceStatus, float, "str | int | None"], None]


class OutputProcessor:
    def __init__(
        self,
        tokenizer: Tokenizer | None,
        grammars: Grammars,
        eos_token_ids: Set[int],
        max_model_len: int,
        vocab_size: int,
        finish: Finish,
    ):
        self.tokenizer = tokenizer
        self.grammars = grammars
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.finish = finish  # records a completion's end and frees its blocks (the scheduler's)

    def new_sequence(self, seq: Sequence, params: SamplingParams, seed: int) -> Sequence:
        """Give a sequence its detokenizer, its grammar matcher and its request's seed."""
        if self.tokenizer is not None:
            seq.detokenizer = IncrementalDetokenizer(
                self.tokenizer,
                seq.prompt_token_ids,
                params.stop,
                skip_special_tokens=params.skip_special_tokens,
            )
        seq.seed = seed
        seq.matcher = self.grammars.matcher(params.response_format)
        return seq

    def advance(
        self,
        request: Request,
        seq: Sequence,
        token: int,
        logprobs: TokenLogprobs | None,
        now: float,
    ) -> StepOutput:
        """Account for one new token of a sequence (already appended): text, grammar, times,
        logprobs, its end; its output."""
        if seq.matcher is not None:
            seq.matcher.consume(token)  # (the mask allowed it: a refusal is an engine fault)
        if seq.first_token_time is None:
            seq.first_token_time = now
        seq.last_token_time = now
        if logprobs is not None:
            seq.logprobs.append(logprobs)
        end, stop_reason, delta = self.ending(seq, token, request.params)
        if end is None:
            seq.text += delta
            return StepOutput(
                request.request_id,
                seq.index,
                [token],
                delta,
                logprobs=[logprobs] if logprobs else [],
            )
        if seq.detokenizer is not None and not seq.detokenizer.stopped:
            delta += seq.detokenizer.flush()  # held-back text that turned out not to be a stop
        self.finish(seq, end, now, stop_reason)
        return final_output(request, seq, [token], delta, [logprobs] if logprobs else [])

    def ending(
        self, seq: Sequence, token: int, params: SamplingParams
    ) -> tuple[SequenceStatus | None, str | int | None, str]:
        """After `seq` took `token`: (its finished status or None, the stop reason, the token's
        text delta)."""
        if not params.ignore_eos and token in self.eos_token_ids:
            return SequenceStatus.FINISHED_STOPPED, token, ""
        if token in params.stop_token_ids:
            return SequenceStatus.FINISHED_STOPPED, token, ""
        delta = ""
        if seq.detokenizer is not None:
            delta, hit = seq.detokenizer.add([token])
            if hit:
                return SequenceStatus.FINISHED_STOPPED, seq.detokenizer.stop_string, delta
        if seq.num_output_tokens >= params.max_tokens or seq.num_tokens >= self.max_model_len:
            return SequenceStatus.FINISHED_LENGTH, None, delta
        return None, None, delta

    def replay(
        self, seq: Sequence, tokens: Iterable[int], params: SamplingParams, now: float
    ) -> None:
        """Give a resumed sequence the tokens it had produced, through the same checks (so its
        text, held-back stop-string prefixes included, is where it was; that text was published
        with those tokens and is not produced again), finishing it if they did. EngineError
        names `resume` where the tokens could not have been produced."""
        for token in tokens:
            if not 0 <= token < self.vocab_size:
                raise EngineError(f"token id {token} is outside the vocabulary", field="resume")
            if seq.is_finished:
                raise EngineError("tokens after the completion had finished", field="resume")
            seq.append_token(token)
            if seq.matcher is not None:
                try:
                    seq.matcher.consume(token)
                except EngineError as exc:
                    raise EngineError(str(exc), field="resume") from None
            end, stop_reason, delta = self.ending(seq, token, params)
            seq.text += delta  # published with the token already
            if end is not None:
                if seq.detokenizer is not None and not seq.detokenizer.stopped:
                    seq.text += seq.detokenizer.flush()  # went out with the last token too
                seq.finish(end, now, stop_reason)  # (not in the scheduler yet)
