"""The events sluice publishes to the tokens topic (``sluice.tokens``) or a request's reply topic.

Per request, keyed by request id so one request's events stay in order on one partition:

* ``token`` events with ``seq`` = 0, 1, 2, ... carrying token ids and the text delta;
* then exactly one terminal event with the next ``seq``: a ``final`` event (finish reason, usage,
  timings, full text), or an ``error`` event when the request could not be served.

Every event carries ``(request_id, seq)``: a request may be processed twice after a crash or a
rebalance, and the replay produces the same events, so a consumer drops an event whose ``seq`` it
has already seen for that request. An ``error`` event for input that could not be decoded at all has
no ``seq`` (and no ``request_id`` when none could be read; it then goes to the dead-letter topic
with the raw bytes in ``raw``).

Unknown-field policy: event consumers IGNORE unknown fields (``extra="ignore"``) and skip events
whose ``type`` they do not know, so adding a field or a new event type is backward compatible and
does not change ``SCHEMA_VERSION``. For the same reason ``ErrorEvent.code`` is a plain string whose
known values are listed in :class:`ErrorCode`: a newer producer may add codes.
"""

from __future__ import annotations

import base64
import math
from enum import StrEnum
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, JsonValue

from .version import SCHEMA_VERSION

LOGPROB_FLOOR = -9999.0
"""Logprobs are clamped into [LOGPROB_FLOOR, 0]: -inf (which JSON cannot carry) is sent as this."""

MAX_RAW_BYTES = 64 * 1024
"""At most this many bytes of an undecodable message are copied into ``ErrorEvent.raw``."""


class ErrorCode(StrEnum):
    """Stable error codes. Clients may branch on them; new codes may be added."""

    INVALID_JSON = "invalid_json"
    """The message is not UTF-8 JSON."""
    INVALID_REQUEST = "invalid_request"
    """The JSON is not a valid request: a field is missing, unknown, of the wrong type or range."""
    UNSUPPORTED_SCHEMA_VERSION = "unsupported_schema_version"
    """``schema_version`` names a version this server does not speak."""
    PROMPT_TOO_LONG = "prompt_too_long"
    """The prompt (after the chat template) does not fit the model's context."""
    DEADLINE_EXCEEDED = "deadline_exceeded"
    """The request's deadline passed before it could be served."""
    OVERLOADED = "overloaded"
    """The request was shed because the pipeline is over capacity."""
    INTERNAL = "internal"
    """A bug or an unexpected failure inside sluice."""


FinishReason = Literal["stop", "length", "abort", "error", "tool_calls"]
"""``stop``: an end-of-sequence token, a stop token or a stop string; ``tool_calls``: so ended,
having made tool calls (a request with tools); ``length``: ``max_tokens`` or
the context length reached; ``abort``: cancelled or past its deadline while generating;
``error``: failed while generating (the error is logged; tokens already sent stay valid)."""


def _clamp_logprob(value: object) -> object:
    """Clamp into [LOGPROB_FLOOR, 0]: -inf and round-off above 0 become valid numbers."""
    if isinstance(value, (int, float)) and not isinstance(value, bool) and not math.isnan(value):
        return min(max(float(value), LOGPROB_FLOOR), 0.0)
    return value


Logprob = Annotated[
    float,
    Field(ge=LOGPROB_FLOOR, le=0.0, allow_inf_nan=False),
    BeforeValidator(_clamp_logprob),
]


def _always_sent(schema: dict[str, Any]) -> None:
    """``schema_version`` and ``type`` have defaults in Python but are always on the wire."""
    props = schema.get("properties", {})
    sent = [name for name in ("schema_version", "type") if name in props]
    if sent:
        schema["required"] = sent + [r for r in schema.get("required", []) if r not in sent]


class _Wire(BaseModel):
    """Base of every event: unknown fields are ignored (forward compatible)."""

    model_config = ConfigDict(extra="ignore", json_schema_extra=_always_sent)


class TopLogprob(_Wire):
    """One of the most likely alternatives at a position."""

    token_id: int = Field(ge=0)
    logprob: Logprob
    token: str | None = Field(
        None,
        description="The token as text; 'bytes:' and escapes when it is not whole UTF-8 "
        "(a piece of a character), as OpenAI writes it.",
    )
    bytes: list[int] | None = Field(None, description="The token's raw bytes.")


class TokenLogprob(_Wire):
    """The sampled token's logprob and the top alternatives (``logprobs`` of them)."""

    token_id: int = Field(ge=0)
    logprob: Logprob
    token: str | None = Field(None, description="The token as text (see TopLogprob.token).")
    bytes: list[int] | None = Field(None, description="The token's raw bytes.")
    top: list[TopLogprob] = Field(default_factory=list)


class CalledFunction(_Wire):
    name: str
    arguments: str = Field(description="A JSON object, as text.")


class GeneratedToolCall(_Wire):
    """A tool call the model made (a request with ``tools``), in OpenAI's shape."""

    index: int = Field(ge=0, description="Its place among its completion's calls: 0, 1, ...")
    id: str = Field(description="The same on every copy and after a resume: call_<24 hex>.")
    type: Literal["function"] = "function"
    function: CalledFunction


class TokenEvent(_Wire):
    """New tokens of one request: the token ids and the text they add."""

    schema_version: int = SCHEMA_VERSION
    type: Literal["token"] = "token"
    request_id: str
    seq: int = Field(ge=0, description="0, 1, 2, ... per request, across all its events.")
    index: int = Field(0, ge=0, description="Which completion (0 .. n-1) these tokens belong to.")
    token_ids: list[int] = Field(default_factory=list)
    text: str = Field("", description="Text delta: append it to the text received so far.")
    logprobs: list[TokenLogprob] | None = Field(
        None, description="One entry per token id, when the request asked for logprobs."
    )
    tool_calls: list[GeneratedToolCall] | None = Field(
        None,
        description="Calls completed by these tokens (a request with tools; the text of a call "
        "is not in `text`).",
    )
    reasoning: str | None = Field(
        None,
        description="Reasoning delta (with a reasoning parser: the thinking is not in `text`).",
    )
    session_id: str | None = None
    metadata: dict[str, JsonValue] | None = None


class Usage(_Wire):
    """Token counts of one request."""

    prompt_tokens: int = Field(ge=0)
    cached_tokens: int = Field(
        0, ge=0, description="Prompt tokens whose KV cache was reused (prefix cache)."
    )
    completion_tokens: int = Field(ge=0, description="Generated tokens, over all completions.")

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


class Timings(_Wire):
    """Latencies of one request, in seconds, as the client sees them: from its publish (the
    request record's timestamp), or from when the pipeline read it when the record had none."""

    queue_s: float = Field(ge=0, description="From publish until its first forward step.")
    ttft_s: float | None = Field(
        None, ge=0, description="Time to first token, from publish; null when none was made."
    )
    tpot_s: float | None = Field(
        None,
        ge=0,
        description="Mean time per output token after the first; null with fewer than 2 tokens.",
    )
    total_s: float = Field(ge=0, description="From publish until the final event.")
    in_topic_s: float | None = Field(
        None,
        ge=0,
        description="Of those, the time before the pipeline read the request (waiting in the "
        "topic: a backlog, a pipeline down); null when its record had no timestamp.",
    )


class Choice(_Wire):
    """The outcome of one completion, when a request asked for ``n`` > 1."""

    index: int = Field(ge=0)
    text: str
    finish_reason: FinishReason
    stop_reason: str | int | None = None
    completion_tokens: int = Field(ge=0)
    logprobs: list[TokenLogprob] | None = Field(
        None, description="Its logprobs, when the request asked for them and did not stream."
    )
    tool_calls: list[GeneratedToolCall] | None = None
    reasoning: str | None = Field(None, description="Its thinking (with a reasoning parser).")


class Failure(_Wire):
    """Why a request ended with finish_reason ``error``."""

    code: str = Field(description="internal: a fault inside sluice while serving the request.")
    message: str


class Provenance(_Wire):
    """What produced the output: with the request and its seed, what a replay needs to match."""

    model: str = Field(description="The model as the runner was given it (a path or file name).")
    weights_sha256: str = Field(
        description="sha256 of the weight files read: a GGUF file, or an HF directory's "
        "*.safetensors files (each name, then its bytes, in name order)."
    )
    tokenizer_sha256: str | None = Field(
        None, description="sha256 of the tokenizer's full definition (its tokenizer.json form)."
    )
    chat_template_sha256: str | None = None
    sluice_version: str
    git_commit: str | None = Field(
        None, description="When sluice runs from a git checkout; '-dirty' with local changes."
    )
    torch_version: str
    dtype: str = Field(description="The model dtype: float32 or bfloat16.")
    quantization: str | None = None
    kv_cache_dtype: str
    kernels: str = Field(
        description="The kernel family: native, torch, triton, or deterministic (native kernels "
        "with every reduction in a fixed order)."
    )
    native_build: str | None = Field(
        None, description="Compiler and flags of the native CPU kernels, where they run."
    )
    widened_from_rows: dict[str, int] | None = Field(
        None,
        description="Quantized projections ('NxK') a step of at least this many rows widens to "
        "bfloat16 for a oneDNN matmul (measured faster at start); null where none is.",
    )
    deterministic: bool = Field(
        description="Tokens depend on the request and seed alone, not on the batch, chunking, "
        "prefix cache or thread count (docs/REPRODUCIBILITY.md)."
    )
    numerics: int | None = Field(
        None,
        description="The version of deterministic mode's arithmetic: under one version a request "
        "and seed give the same bits on every CPU the kernels serve (absent before version 1).",
    )
    device: str
    device_name: str = Field(description="The CPU model, or the GPU and its compute capability.")
    cpu_features: list[str] = Field(
        default_factory=list,
        description="The CPU's instruction-set features that choose kernels, and so rounding.",
    )
    tool_format: str | None = Field(
        None,
        description="How tool calls are written and read (hermes, llama3_json, mistral, pythonic): "
        "it shapes a tool request's prompt and grammar.",
    )
    reasoning_format: str | None = Field(
        None,
        description="How the model's thinking is told from its answer (qwen3, deepseek_r1); "
        "none: its text is all content.",
    )


class FinalEvent(_Wire):
    """The last event of a served request."""

    schema_version: int = SCHEMA_VERSION
    type: Literal["final"] = "final"
    request_id: str
    seq: int = Field(ge=0, description="One past the last token event's seq.")
    finish_reason: FinishReason
    stop_reason: str | int | None = Field(
        None, description="The stop string or stop token id that ended the text, if any."
    )
    usage: Usage
    timings: Timings
    model: str
    text: str = Field(
        description="The full generated text (of completion 0 when n > 1), less its reasoning "
        "and its tool calls."
    )
    tool_calls: list[GeneratedToolCall] | None = Field(
        None, description="Every call completion 0 made (a request with tools)."
    )
    reasoning: str | None = Field(
        None, description="Completion 0's thinking (with a reasoning parser), apart from `text`."
    )
    choices: list[Choice] | None = Field(None, description="Every completion, only when n > 1.")
    logprobs: list[TokenLogprob] | None = Field(
        None,
        description="Completion 0's logprobs, when the request asked for them and did not "
        "stream (with n > 1, each choice has its own).",
    )
    seed: int | None = Field(
        None, description="The request's seed, or the one it was given: send it to replay it."
    )
    provenance: Provenance | None = Field(
        None, description="What produced the output (`sluice replay` compares it)."
    )
    error: Failure | None = Field(
        None, description="Why it failed, when finish_reason is error (the tokens sent stay valid)."
    )
    session_id: str | None = None
    metadata: dict[str, JsonValue] | None = None


class ErrorEvent(_Wire):
    """A request that could not be served, or input that was not a request at all."""

    schema_version: int = SCHEMA_VERSION
    type: Literal["error"] = "error"
    request_id: str | None = Field(None, description="Null when no request id could be read.")
    seq: int | None = Field(None, ge=0)
    code: str = Field(
        description="Stable code: " + ", ".join(c.value for c in ErrorCode) + " (more may come)."
    )
    message: str = Field(description="Human-readable: names the field and the reason.")
    field: str | None = Field(None, description="Dotted path of the offending field, if any.")
    raw: str | None = Field(
        None, description="Base64 of the raw message (first 64 KiB), on the dead-letter topic."
    )
    raw_size: int | None = Field(None, ge=0, description="Size in bytes of the raw message.")
    session_id: str | None = None
    metadata: dict[str, JsonValue] | None = None

    @classmethod
    def for_request(
        cls,
        request: object,
        code: str,
        message: str,
        *,
        field: str | None = None,
        seq: int | None = None,
    ) -> ErrorEvent:
        """An error about a decoded request, echoing its request id, session id and metadata."""
        return cls(
            request_id=getattr(request, "request_id", None),
            session_id=getattr(request, "session_id", None),
            metadata=getattr(request, "metadata", None),
            code=str(code),
            message=message,
            field=field,
            seq=seq,
        )

    def with_raw(self, raw: bytes, limit: int = MAX_RAW_BYTES) -> ErrorEvent:
        """A copy carrying (the first ``limit`` bytes of) ``raw`` in base64."""
        return self.model_copy(
            update={
                "raw": base64.b64encode(bytes(raw[:limit])).decode("ascii"),
                "raw_size": len(raw),
            }
        )

    def raw_bytes(self) -> bytes | None:
        """The raw message bytes carried in ``raw`` (possibly truncated; see ``raw_size``)."""
        return None if self.raw is None else base64.b64decode(self.raw)


OutputEvent = Annotated[TokenEvent | FinalEvent | ErrorEvent, Field(discriminator="type")]
"""Any event on the tokens topic, told apart by ``type``."""

EVENT_TYPES: tuple[str, ...] = ("token", "final", "error")
