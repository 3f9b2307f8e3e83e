"""The request a client publishes to the requests topic (``sluice.requests``).

One JSON object per Kafka message, UTF-8, keyed by session id (or request id) so that the turns of
a conversation stay in order on one partition. See ``docs/SCHEMAS.md`` for the full wire format.

Unknown-field policy: a request is validated *strictly*. Unknown fields are rejected
(``extra="forbid"``), so a misspelled parameter such as ``"max_token"`` is an ``invalid_request``
error naming the field, never silently ignored. Types are not coerced either: ``"max_tokens": "5"``
or ``"ignore_eos": 1`` are errors (an integer is accepted where a number is expected).

The prompt is either ``prompt`` (plain text, no chat template) or ``messages`` (a chat, rendered
with the model's chat template); exactly one must be given. The sampling fields mirror the engine's
sampling parameters one to one; :meth:`GenerateRequest.sampling_kwargs` hands them over.
"""

from __future__ import annotations

import json
import math
import uuid
from datetime import UTC, datetime
from typing import Annotated, Any, Literal, get_args

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    JsonValue,
    WithJsonSchema,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from .tools import MAX_TOOL_CALLS, MAX_TOOLS, Tool, ToolCall, ToolChoice, check_tools
from .version import SCHEMA_VERSION, SUPPORTED_VERSIONS

MAX_ID_LENGTH = 128
MAX_TENANT_LENGTH = 64
MAX_TOPIC_LENGTH = 249
MAX_STOP_STRINGS = 16
MAX_STOP_TOKEN_IDS = 256
MAX_TOKENS_LIMIT = 1_000_000
MAX_N = 16
MAX_LOGPROBS = 20
MAX_METADATA_BYTES = 16 * 1024

_TOPIC_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._-")

# The request fields that are sampling parameters, named as the engine names them.
SAMPLING_FIELDS: tuple[str, ...] = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "max_tokens",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "n",
    "logprobs",
    "seed",
    "skip_special_tokens",
    "response_format",
)


def new_request_id() -> str:
    """A fresh request id: 32 lowercase hex digits of a random UUID4."""
    return uuid.uuid4().hex


def _check_id(value: str, limit: int) -> str:
    if not value:
        raise PydanticCustomError("invalid_id", "must not be empty")
    if len(value) > limit:
        raise PydanticCustomError(
            "invalid_id", "must be at most {limit} characters", {"limit": limit}
        )
    if not all("\x21" <= ch <= "\x7e" for ch in value):
        raise PydanticCustomError(
            "invalid_id",
            "must be printable ASCII without spaces",
        )
    return value


def _request_id(value: str) -> str:
    return _check_id(value, MAX_ID_LENGTH)


def _session_id(value: str) -> str:
    return _check_id(value, MAX_ID_LENGTH)


def _tenant(value: str) -> str:
    return _check_id(value, MAX_TENANT_LENGTH)


def _topic(value: str) -> str:
    if not value or len(value) > MAX_TOPIC_LENGTH:
        raise PydanticCustomError(
            "invalid_topic", "must be 1 to {limit} characters", {"limit": MAX_TOPIC_LENGTH}
        )
    if value in (".", "..") or not set(value) <= _TOPIC_CHARS:
        raise PydanticCustomError(
            "invalid_topic",
            "must be a Kafka topic name: letters, digits, '.', '_' and '-' only, not '.' or '..'",
        )
    return value


def _deadline(value: Any) -> Any:
    """Accept unix seconds (a number) or an ISO 8601 datetime (string or ``datetime``)."""
    if isinstance(value, str):
        try:
            value = datetime.fromisoformat(value)
        except ValueError:
            raise PydanticCustomError(
                "invalid_deadline",
                "must be unix seconds or an ISO 8601 datetime such as '2030-01-01T00:00:00Z'",
            ) from None
    if isinstance(value, datetime):
        if value.tzinfo is None:  # a datetime without zone is read as UTC
            value = value.replace(tzinfo=UTC)
        return value.timestamp()
    return value


def _id_schema(limit: int, description: str) -> WithJsonSchema:
    return WithJsonSchema(
        {"type": "string", "pattern": f"^[!-~]{{1,{limit}}}$", "description": description}
    )


# Ids are printable ASCII without spaces: safe as Kafka keys, Redis keys and in log lines.
RequestId = Annotated[
    str,
    AfterValidator(_request_id),
    _id_schema(MAX_ID_LENGTH, "Printable ASCII without spaces, 1 to 128 characters."),
]
SessionId = Annotated[
    str,
    AfterValidator(_session_id),
    _id_schema(MAX_ID_LENGTH, "Printable ASCII without spaces, 1 to 128 characters."),
]
Tenant = Annotated[
    str,
    AfterValidator(_tenant),
    _id_schema(MAX_TENANT_LENGTH, "Printable ASCII without spaces, 1 to 64 characters."),
]
TopicName = Annotated[
    str,
    AfterValidator(_topic),
    WithJsonSchema(
        {
            "type": "string",
            "pattern": f"^(?!\\.{{1,2}}$)[a-zA-Z0-9._-]{{1,{MAX_TOPIC_LENGTH}}}$",
            "description": "A Kafka topic name.",
        }
    ),
]
Deadline = Annotated[
    float,
    BeforeValidator(_deadline),
    WithJsonSchema(
        {
            "anyOf": [
                {"type": "number", "minimum": 0},
                {"type": "string", "format": "date-time"},
            ],
            "description": "Unix seconds, or an ISO 8601 datetime (UTC when no zone is given).",
        }
    ),
]


class Message(BaseModel):
    """One chat message: an assistant's may hold the tool calls it made (and then no content), a
    tool's brings a call's result (and names the call, as OpenAI's clients do)."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    role: Literal["system", "user", "assistant", "tool"]
    content: str | None = None
    tool_calls: list[ToolCall] | None = Field(None, min_length=1, max_length=MAX_TOOL_CALLS)
    tool_call_id: str | None = Field(None, min_length=1, max_length=128)

    @model_validator(mode="after")
    def _fits_role(self) -> Message:
        if self.tool_calls is not None and self.role != "assistant":
            raise PydanticCustomError(
                "role_conflict",
                "only an assistant message makes tool calls",
                {"field": "tool_calls"},
            )
        if self.tool_call_id is not None and self.role != "tool":
            raise PydanticCustomError(
                "role_conflict", "only a tool message answers a call", {"field": "tool_call_id"}
            )
        if self.content is None and self.tool_calls is None:
            raise PydanticCustomError(
                "missing_content",
                "field required (an assistant message may give tool_calls instead)",
                {"field": "content"},
            )
        return self


class _Format(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class TextFormat(_Format):
    type: Literal["text"]


class JsonObjectFormat(_Format):
    type: Literal["json_object"]


class JsonSchemaSpec(_Format):
    name: str | None = Field(None, max_length=64)
    description: str | None = None
    schema_: dict[str, JsonValue] = Field(alias="schema", description="The JSON Schema.")
    strict: bool | None = Field(None, description="Accepted; the schema is always enforced.")

    model_config = ConfigDict(
        extra="forbid", strict=True, frozen=True, populate_by_name=True, serialize_by_alias=True
    )


class JsonSchemaFormat(_Format):
    type: Literal["json_schema"]
    json_schema: JsonSchemaSpec


class RegexFormat(_Format):
    type: Literal["regex"]
    regex: str = Field(min_length=1, description="The whole text must match it.")


class GrammarFormat(_Format):
    type: Literal["grammar"]
    grammar: str = Field(min_length=1, description="A context-free grammar in Lark syntax.")


_FORMATS = (TextFormat, JsonObjectFormat, JsonSchemaFormat, RegexFormat, GrammarFormat)
ResponseFormat = Annotated[
    TextFormat | JsonObjectFormat | JsonSchemaFormat | RegexFormat | GrammarFormat,
    Field(discriminator="type"),
]
# Their `type` values: the tags of the union.
RESPONSE_FORMAT_TYPES: tuple[str, ...] = tuple(
    get_args(f.model_fields["type"].annotation)[0] for f in _FORMATS
)


MAX_KEEP_KV_S = 3600.0


class KeepKv(BaseModel):
    """Keep a request's KV cached for the request that will extend its conversation."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    key: str = Field(
        min_length=1,
        max_length=MAX_ID_LENGTH,
        description="Names the conversation (a harness run's id, say): the next request with "
        "the same key releases this one's pin once it has taken its prefix.",
    )
    seconds: float = Field(
        gt=0, le=MAX_KEEP_KV_S, allow_inf_nan=False, description="The longest it is kept."
    )


class GenerateRequest(BaseModel):
    """A generation request: a prompt (or chat), sampling parameters and routing hints."""

    model_config = ConfigDict(
        extra="forbid",
        strict=True,
        title="GenerateRequest",
        # the one rule a JSON Schema can say and a field cannot: exactly one of prompt, messages
        json_schema_extra={
            "oneOf": [
                {"required": ["prompt"], "properties": {"prompt": {"type": "string"}}},
                {"required": ["messages"], "properties": {"messages": {"type": "array"}}},
            ]
        },
    )

    schema_version: Annotated[
        int,
        WithJsonSchema({"type": "integer", "const": SCHEMA_VERSION, "default": SCHEMA_VERSION}),
    ] = Field(SCHEMA_VERSION, description="Wire schema version; absent means 1.")

    # identity and routing
    request_id: RequestId = Field(
        default_factory=new_request_id,
        description=(
            "Client-chosen id, echoed on every event; a uuid4 hex is generated when absent."
        ),
    )
    session_id: SessionId | None = Field(
        None,
        description=(
            "Conversation id: turns of one session reuse the cached prefix of earlier ones."
        ),
    )
    tenant: Tenant | None = Field(
        None, description="Tenant; sessions and prefix caches are kept apart per tenant."
    )
    reply_topic: TopicName | None = Field(
        None, description="Topic to publish this request's events to instead of the default."
    )
    priority: int = Field(
        0, ge=-(2**31), le=2**31 - 1, description="Lower is served sooner; default 0."
    )
    deadline: Deadline | None = Field(
        None,
        description="Give up after this time (unix seconds or ISO 8601 datetime); "
        "a request already past its deadline gets a deadline_exceeded error event; one that "
        "passes it while generating ends with finish_reason 'abort' and stop_reason 'deadline'.",
    )

    # the prompt: exactly one of these two
    prompt: str | None = Field(
        None, min_length=1, description="Plain-text prompt (no chat template applied)."
    )
    messages: list[Message] | None = Field(
        None, min_length=1, description="Chat messages, rendered with the model's chat template."
    )

    # sampling parameters (mirror the engine's)
    temperature: float = Field(1.0, ge=0.0, allow_inf_nan=False, description="0 means greedy.")
    top_p: float = Field(1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: int = Field(0, ge=-1, description="0 or -1: off; otherwise keep the k most likely.")
    min_p: float = Field(0.0, ge=0.0, le=1.0, allow_inf_nan=False)
    repetition_penalty: float = Field(1.0, gt=0.0, allow_inf_nan=False)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0, allow_inf_nan=False)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0, allow_inf_nan=False)
    max_tokens: int = Field(256, ge=1, le=MAX_TOKENS_LIMIT, description="Most tokens to generate.")
    stop: list[Annotated[str, Field(min_length=1)]] = Field(
        default_factory=list,
        max_length=MAX_STOP_STRINGS,
        description="Stop strings; the text ends before the first one found.",
    )
    stop_token_ids: list[Annotated[int, Field(ge=0)]] = Field(
        default_factory=list, max_length=MAX_STOP_TOKEN_IDS
    )
    ignore_eos: bool = False
    n: int = Field(1, ge=1, le=MAX_N, description="Number of completions.")
    logprobs: int | None = Field(
        None,
        ge=0,
        le=MAX_LOGPROBS,
        description="Return the sampled token's logprob and this many top alternatives.",
    )
    seed: int | None = Field(None, ge=0, lt=2**64)
    skip_special_tokens: bool = Field(
        True, description="Leave special tokens (such as <|im_end|>) out of the text."
    )
    response_format: ResponseFormat | None = Field(
        None,
        description="A shape the text must have: json_object, json_schema (OpenAI's forms), "
        "regex or grammar (Lark); enforced token by token.",
    )

    tools: list[Tool] | None = Field(
        None,
        min_length=1,
        max_length=MAX_TOOLS,
        description="Functions the model may call (chat requests): their calls come back as "
        "tool_calls with finish_reason tool_calls.",
    )
    tool_choice: ToolChoice | None = Field(
        None,
        description="auto (the default with tools): the model chooses; none: no calls; "
        "required: one call or more and nothing else; {type: function, function: {name}}: "
        "one call of that function. required and named calls follow the tools' schemas.",
    )
    parallel_tool_calls: bool = Field(True, description="false: at most one call per answer.")
    keep_kv: KeepKv | None = Field(
        None,
        description="Once it ends, keep its KV (prompt and answer) in the prefix cache under "
        "`key` for up to `seconds`, so that the request that extends the conversation (a "
        "harness's next turn, after its tools ran) finds it; running requests still take the "
        "room first when the cache is full.",
    )

    metadata: dict[str, JsonValue] | None = Field(
        None,
        description="Free JSON object echoed back on the final and error events "
        f"(at most {MAX_METADATA_BYTES} bytes serialized).",
    )

    # how the answer is sent
    stream: bool = Field(
        True,
        description="false: no token events, only the final one (which has the whole text).",
    )
    event_format: Literal["sluice", "openai"] | None = Field(
        None,
        description="The shape of this request's events: sluice's own, or OpenAI's "
        "chat.completion(.chunk) / text_completion objects; null: the pipeline's "
        "--event-format (requests in an OpenAI shape default to openai).",
    )

    # ---- validators -------------------------------------------------------------------------

    @field_validator("schema_version")
    @classmethod
    def _check_version(cls, value: int) -> int:
        if value not in SUPPORTED_VERSIONS:
            raise PydanticCustomError(
                "unsupported_schema_version",
                "unsupported version {got}; this server speaks {supported}",
                {"got": value, "supported": ", ".join(map(str, sorted(SUPPORTED_VERSIONS)))},
            )
        return value

    @field_validator("metadata")
    @classmethod
    def _check_metadata(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value is None:
            return None
        try:
            text = json.dumps(value, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
            size = len(text.encode("utf-8"))
        except ValueError:  # NaN or Infinity; UnicodeEncodeError: a lone surrogate
            raise PydanticCustomError(
                "invalid_metadata", "must contain only finite numbers and valid Unicode"
            ) from None
        if size > MAX_METADATA_BYTES:
            raise PydanticCustomError(
                "metadata_too_large",
                "is {size} bytes serialized; at most {limit} allowed",
                {"size": size, "limit": MAX_METADATA_BYTES},
            )
        return value

    @field_validator("deadline")
    @classmethod
    def _check_deadline(cls, value: float | None) -> float | None:
        if value is not None and (not math.isfinite(value) or value < 0):
            raise PydanticCustomError("invalid_deadline", "must be a finite time >= 0")
        return value

    @model_validator(mode="after")
    def _one_prompt(self) -> GenerateRequest:
        if self.prompt is None and self.messages is None:
            raise PydanticCustomError(
                "prompt_required",
                "field required (give either prompt or messages)",
                {"field": "prompt"},
            )
        if self.prompt is not None and self.messages is not None:
            raise PydanticCustomError(
                "prompt_conflict",
                "give either prompt or messages, not both",
                {"field": "messages"},
            )
        return self

    @model_validator(mode="after")
    def _tools_fit(self) -> GenerateRequest:
        check_tools(self.tools, self.tool_choice, self.messages is not None)
        calls_only = self.tools is not None and self.tool_choice not in (None, "auto", "none")
        if calls_only and self.response_format is not None and self.response_format.type != "text":
            raise PydanticCustomError(
                "conflict",
                "give a response_format or a tool_choice that requires calls, not both",
                {"field": "tool_choice"},
            )
        return self

    # ---- helpers ----------------------------------------------------------------------------

    @property
    def is_chat(self) -> bool:
        """True when the prompt is given as chat ``messages``."""
        return self.messages is not None

    def sampling_kwargs(self) -> dict[str, Any]:
        """The sampling parameters as keyword arguments for the engine's sampling params."""
        out = {name: getattr(self, name) for name in SAMPLING_FIELDS}
        out["stop"] = list(self.stop)
        out["stop_token_ids"] = list(self.stop_token_ids)
        if self.response_format is not None:
            out["response_format"] = self.response_format.model_dump(
                by_alias=True, exclude_none=True
            )
        return out
