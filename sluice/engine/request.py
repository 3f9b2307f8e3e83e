"""One request in the engine (`Request`): its prompt, checked against the model (`prompt_ids`), its
n completions, and what it reports: a completion's final output (`final_output`), the request's
usage and a completion's timings, and the whole result `generate` returns (`result`)."""

from __future__ import annotations

from collections.abc import Iterable
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import Any

from sluice.engine.errors import EngineError
from sluice.engine.outputs import GenerateResult, SampleResult, StepOutput, Timings, Usage
from sluice.engine.sampler import TokenLogprobs
from sluice.engine.sampling_params import SamplingParams
from sluice.engine.sequence import Sequence
from sluice.engine.tokenizer import Tokenizer


@dataclass
class Request:
    """One request in the engine: its prompt and parameters, and the sequences of its n samples
    (one at first; the others fork from it after the prompt's first sampling step)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    seqs: list[Sequence]
    seed: int  # the request's, or one given to it: reported with its final outputs
    first_scheduled_time: float | None = None

    @property
    def finished(self) -> bool:
        return len(self.seqs) == self.params.n and all(s.is_finished for s in self.seqs)


def prompt_ids(
    tokenizer: Tokenizer | None,
    vocab_size: int,
    prompt: str | None,
    prompt_token_ids: Seq[int] | None,
    messages: Seq[dict] | None,
) -> tuple[str | None, list[int]]:
    """The prompt's text (when it has one) and token ids, from exactly one of the three forms,
    checked against the model; EngineError names the field at fault."""
    given = [x is not None for x in (prompt, prompt_token_ids, messages)]
    if sum(given) != 1:
        raise EngineError(
            "give exactly one of prompt, prompt_token_ids or messages", field="prompt"
        )
    if prompt_token_ids is not None:
        ids = [int(t) for t in prompt_token_ids]
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise EngineError(
                f"token id {bad[0]} is outside the vocabulary (size {vocab_size})",
                field="prompt_token_ids",
            )
    elif tokenizer is None:
        raise EngineError("this model has no tokenizer: pass prompt_token_ids", field="prompt")
    elif messages is not None:
        if not messages:
            raise EngineError("no messages", field="messages")
        prompt = tokenizer.apply_chat_template(list(messages), add_generation_prompt=True)
        ids = tokenizer.encode(prompt, add_special_tokens=False)
    else:
        if not isinstance(prompt, str) or not prompt:
            raise EngineError("the prompt is empty", field="prompt")
        ids = tokenizer.encode(prompt)
    if not ids:
        raise EngineError("the prompt has no tokens", field="prompt")
    return prompt, ids


def prompts_and_params(
    prompts: str | Iterable[str] | None,
    params: SamplingParams | Seq[SamplingParams] | None,
    prompt_token_ids: Seq[Seq[int]] | None,
    messages: Seq[Seq[dict]] | None,
) -> tuple[str, list[Any], list[SamplingParams | None]]:
    """`generate`'s arguments as (the prompts' form: "prompt", "prompt_token_ids" or "messages",
    the prompts, each one's parameters); EngineError where they are not exactly one form, or
    the parameters are not one for all or one each."""
    if isinstance(prompts, str):
        prompts = [prompts]
    kinds = [
        (k, list(v))
        for k, v in (
            ("prompt", prompts),
            ("prompt_token_ids", prompt_token_ids),
            ("messages", messages),
        )
        if v is not None
    ]
    if len(kinds) != 1:
        raise EngineError(
            "give exactly one of prompts, prompt_token_ids or messages", field="prompt"
        )
    kind, items = kinds[0]
    per_item: list[SamplingParams | None]
    if params is None or isinstance(params, SamplingParams):
        per_item = [params] * len(items)
    else:
        per_item = list(params)
    if len(per_item) != len(items):
        raise EngineError(
            f"{len(per_item)} sampling params for {len(items)} prompts", field="params"
        )
    return kind, items, per_item


def final_output(
    request: Request,
    seq: Sequence,
    tokens: list[int],
    delta: str,
    logprobs: list[TokenLogprobs] | None = None,
) -> StepOutput:
    """A finished completion's last output: its last tokens and text, with how it ended, the
    request's usage, its timings and the request's seed."""
    seq.text += delta
    return StepOutput(
        request.request_id,
        seq.index,
        tokens,
        delta,
        finished=True,
        finish_reason=seq.finish_reason,
        stop_reason=seq.stop_reason,
        logprobs=logprobs or [],
        usage=usage(request),
        timings=timings(request, seq),
        seed=request.seed,
    )


def usage(request: Request) -> Usage:
    """The request's tokens: its prompt's, those the prefix cache served, all its completions'."""
    return Usage(
        prompt_tokens=len(request.prompt_token_ids),
        cached_tokens=request.seqs[0].num_cached_tokens,
        completion_tokens=sum(s.num_output_tokens for s in request.seqs),
    )


def timings(request: Request, seq: Sequence) -> Timings:
    """One completion's times, from the request's arrival."""

    def since(t: float | None, start: float | None) -> float | None:
        return None if t is None or start is None else t - start

    n = seq.num_output_tokens
    tpot = None
    if n > 1 and seq.first_token_time is not None and seq.last_token_time is not None:
        tpot = (seq.last_token_time - seq.first_token_time) / (n - 1)
    return Timings(
        queue_s=since(request.first_scheduled_time, request.arrival_time),
        ttft_s=since(seq.first_token_time, request.arrival_time),
        tpot_s=tpot,
        total_s=since(seq.finished_time, request.arrival_time),
    )


def result(request: Request) -> GenerateResult:
    """A finished request as `generate` returns it: its samples in index order."""
    samples = [
        SampleResult(
            index=s.index,
            token_ids=s.output_token_ids,
            text=s.text,
            finish_reason=s.finish_reason,
            stop_reason=s.stop_reason,
            logprobs=s.logprobs,
            timings=timings(request, s),
        )
        for s in sorted(request.seqs, key=lambda s: s.index)
    ]
    return GenerateResult(
        request.request_id,
        request.prompt,
        request.prompt_token_ids,
        samples,
        usage(request),
        request.seed,
    )
