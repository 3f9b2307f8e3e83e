"""How one request wants its tokens chosen and when to stop; the names and ranges follow
vLLM/OpenAI."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from sluice.engine.errors import EngineError

MAX_LOGPROBS = 20  # the most top alternatives a request may ask for (OpenAI's limit)


@dataclass
class SamplingParams:
    temperature: float = 1.0  # 0 = greedy (argmax)
    top_p: float = 1.0  # keep the smallest set of tokens whose probability reaches top_p
    top_k: int = 0  # keep the k most likely tokens; 0 or -1 = off
    min_p: float = 0.0  # drop tokens less likely than min_p x the most likely one
    repetition_penalty: float = 1.0  # >1 discourages any token of prompt or output (HF/CTRL style)
    presence_penalty: float = 0.0  # subtracted once from tokens the output already has
    frequency_penalty: float = 0.0  # subtracted per occurrence in the output
    max_tokens: int = 16
    stop: list[str] = field(default_factory=list)  # generation ends before the first of these
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    n: int = 1  # independent completions of the same prompt
    logprobs: int | None = None  # None = none; k >= 0: the chosen token's + the k most likely
    seed: int | None = None  # per-request generator: same seed, same draws, whatever the batch
    skip_special_tokens: bool = True  # leave special tokens (<|im_end|>, ...) out of the text
    # A grammar the output follows (JSON Schema, JSON object, regex, Lark): `structured.py`.
    response_format: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):  # OpenAI accepts a single string
            self.stop = [self.stop]

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def validate(self) -> None:
        """Raise EngineError naming the first field whose value is out of range."""
        _number("temperature", self.temperature)
        if self.temperature < 0:
            raise EngineError(f"must be >= 0, got {self.temperature}", "temperature")
        _number("top_p", self.top_p)
        if not 0 < self.top_p <= 1:
            raise EngineError(f"must be in (0, 1], got {self.top_p}", "top_p")
        _integer("top_k", self.top_k)
        if self.top_k < -1:
            raise EngineError(
                f"must be -1 or 0 (off) or a positive count, got {self.top_k}", "top_k"
            )
        _number("min_p", self.min_p)
        if not 0 <= self.min_p <= 1:
            raise EngineError(f"must be in [0, 1], got {self.min_p}", "min_p")
        _number("repetition_penalty", self.repetition_penalty)
        if self.repetition_penalty <= 0:
            raise EngineError(f"must be > 0, got {self.repetition_penalty}", "repetition_penalty")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _number(name, value)
            if not -2 <= value <= 2:
                raise EngineError(f"must be in [-2, 2], got {value}", name)
        _integer("max_tokens", self.max_tokens)
        if self.max_tokens < 1:
            raise EngineError(f"must be >= 1, got {self.max_tokens}", "max_tokens")
        if not isinstance(self.stop, (list, tuple)) or not all(
            isinstance(s, str) for s in self.stop
        ):
            raise EngineError("must be a list of strings", "stop")
        if any(not s for s in self.stop):
            raise EngineError("stop strings must be non-empty", "stop")
        if not isinstance(self.stop_token_ids, (list, tuple)):
            raise EngineError("must be a list of token ids", "stop_token_ids")
        for t in self.stop_token_ids:
            _integer("stop_token_ids", t)
            if t < 0:
                raise EngineError(f"token ids are >= 0, got {t}", "stop_token_ids")
        if not isinstance(self.ignore_eos, bool):
            raise EngineError("must be true or false", "ignore_eos")
        if not isinstance(self.skip_special_tokens, bool):
            raise EngineError("must be true or false", "skip_special_tokens")
        _integer("n", self.n)
        if self.n < 1:
            raise EngineError(f"must be >= 1, got {self.n}", "n")
        if self.logprobs is not None:
            _integer("logprobs", self.logprobs)
            if not 0 <= self.logprobs <= MAX_LOGPROBS:
                raise EngineError(
                    f"must be in [0, {MAX_LOGPROBS}], got {self.logprobs}", "logprobs"
                )
        if self.seed is not None:
            _integer("seed", self.seed)
            if not 0 <= self.seed < 2**64:
                raise EngineError(f"must be in [0, 2**64), got {self.seed}", "seed")
        if self.response_format is not None:
            if not isinstance(self.response_format, dict):
                raise EngineError("must be an object", "response_format")
            if self.ignore_eos and self.response_format.get("type") != "text":
                raise EngineError(
                    "cannot follow a response format and ignore the end of sequence: the "
                    "grammar ends the text",
                    "ignore_eos",
                )


def _number(name: str, value: object) -> None:
    # bool is an int subclass; `temperature=True` is a client bug, not 1.0.
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise EngineError(f"must be a finite number, got {value!r}", name)


def _integer(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise EngineError(f"must be an integer, got {value!r}", name)
