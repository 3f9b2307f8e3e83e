"""What the engine hands back: per-step deltas for streaming, and whole results for `generate`."""

from __future__ import annotations

from dataclasses import dataclass, field

from sluice.engine.sampler import TokenLogprobs


@dataclass
class Usage:
    prompt_tokens: int
    cached_tokens: int  # prompt tokens served by the prefix cache instead of computed
    completion_tokens: int


@dataclass
class Timings:
    """Seconds, from the engine's clock (time.monotonic)."""

    queue_s: float | None  # arrival -> first scheduled
    ttft_s: float | None  # arrival -> first token
    tpot_s: float | None  # mean time per output token after the first
    total_s: float | None  # arrival -> finished


@dataclass
class StepOutput:
    """What one step produced for one sample of one request."""

    request_id: str
    index: int  # which of the request's n samples
    new_token_ids: list[int]
    text: str  # text delta, safe to show (no partial characters, no stop text)
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    # Set on the finishing output:
    usage: Usage | None = None
    timings: Timings | None = None
    seed: int | None = None  # the request's seed (given to it when it had none)
    error: str | None = None  # why it failed, with finish_reason "error"


@dataclass
class SampleResult:
    index: int
    token_ids: list[int]
    text: str
    finish_reason: str | None
    stop_reason: str | int | None
    logprobs: list[TokenLogprobs]
    timings: Timings


@dataclass
class GenerateResult:
    """A finished request: its prompt and its n samples."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    samples: list[SampleResult]
    usage: Usage
    seed: int  # the request's seed (given to it when it had none)

    # The first sample, for the common n == 1 case.
    @property
    def text(self) -> str:
        return self.samples[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.samples[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.samples[0].finish_reason

    @property
    def timings(self) -> Timings:
        return self.samples[0].timings
