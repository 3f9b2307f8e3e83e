"""OpenAI's Chat Completions and Completions request shapes, accepted on the requests topic.

The rule: a request object with a ``model`` field is in an OpenAI shape (sluice's own requests have
no such field): a Chat Completions request when it has ``messages``, a Completions request
otherwise. It is validated as that shape, as strictly as sluice's own (an unknown field is an error
with a "did you mean"), and every field OpenAI defines that sluice does not serve is an error that
names it and says why, never silently dropped. Then it is mapped onto a :class:`GenerateRequest`:

* ``messages`` (content a string or a list of ``{"type": "text"}`` parts, joined with newlines;
  the ``developer`` role is the ``system`` role), or ``prompt`` (a string, or a list of one);
* ``max_completion_tokens`` (or ``max_tokens``) -> ``max_tokens``; ``stop`` as a string or a list;
* Chat ``logprobs: true`` with ``top_logprobs: k`` -> ``logprobs: k``; Completions' integer
  ``logprobs`` as is;
* ``stream`` (OpenAI's default is false: one final object); ``stream_options.include_usage`` is
  accepted, and usage is always on the last chunk;
* ``temperature``, ``top_p``, ``n``, ``seed``, ``presence_penalty``, ``frequency_penalty``,
  ``metadata``, ``response_format`` (structured output: ``json_object``, ``json_schema``),
  ``tools``, ``tool_choice`` and ``parallel_tool_calls`` (an assistant message's ``tool_calls``
  and a tool message's ``tool_call_id`` too: ``schemas/tools.py``); the
  extras vLLM users send (``top_k``, ``min_p``, ``repetition_penalty``, ``ignore_eos``,
  ``stop_token_ids``, ``skip_special_tokens``) and sluice's own routing fields
  (``request_id``, ``session_id``, ``tenant``, ``reply_topic``, ``priority``, ``deadline``) pass
  through under their own names and are checked as sluice checks them;
* ``model`` names what the client expects; the pipeline answers with the model it serves and says
  which in every event. ``user`` is accepted and unused (OpenAI's end-user id for abuse reports).

Such a request's events are OpenAI's objects too unless it says ``"event_format": "sluice"``.
A ``null`` field means the field is absent, as OpenAI clients send it.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    JsonValue,
    model_validator,
)
from pydantic_core import PydanticCustomError

from .request import MAX_LOGPROBS, MAX_TOKENS_LIMIT

_OFF: tuple[Any, ...] = (None, False, [], {})


def _refuse(why: str, harmless: tuple[Any, ...] = ()) -> AfterValidator:
    """Fails for any value but null, false, an empty array or object, or one of `harmless`
    (values that ask for what sluice does anyway)."""

    def check(value: Any) -> Any:
        if any(value == off and type(value) is type(off) for off in (*_OFF, *harmless)):
            return value
        raise PydanticCustomError("unsupported_field", "not supported by sluice: " + why)

    return AfterValidator(check)


# OpenAI's deprecated function calling: any value but null fails.
_FUNCTIONS = Annotated[JsonValue, _refuse("the deprecated function calling (use tools)")]
_PASS = JsonValue  # passed on under the same name and checked by GenerateRequest

# The fields every shape passes on unchanged: OpenAI's, vLLM's extras and sluice's own.
PASSTHROUGH: tuple[str, ...] = (
    "temperature",
    "top_p",
    "n",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "max_tokens",
    "metadata",
    "top_k",
    "min_p",
    "repetition_penalty",
    "ignore_eos",
    "stop_token_ids",
    "skip_special_tokens",
    "schema_version",
    "request_id",
    "session_id",
    "tenant",
    "reply_topic",
    "priority",
    "deadline",
    "event_format",
    "response_format",
)
# ... and those Chat Completions requests alone pass on.
CHAT_PASSTHROUGH: tuple[str, ...] = ("tools", "tool_choice", "parallel_tool_calls")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class TextPart(_Strict):
    """A part of a message's content; only text parts are served."""

    type: Literal["text"]
    text: str

    @model_validator(mode="before")
    @classmethod
    def _text_only(cls, value: Any) -> Any:
        kind = value.get("type") if isinstance(value, dict) else None
        if isinstance(kind, str) and kind != "text":
            raise PydanticCustomError(
                "unsupported_field",
                "not supported by sluice: {kind} parts (text parts only)",
                {"kind": kind},
            )
        return value


def _text_or_parts(value: Any) -> Any:
    if value is None:
        return None
    if isinstance(value, str):
        return [{"type": "text", "text": value}]
    if not isinstance(value, list):
        raise PydanticCustomError("content_type", "must be a string or an array of text parts")
    return value


def _listed(value: Any) -> Any:
    return [value] if isinstance(value, str) else value


def _one_prompt(value: Any) -> Any:
    if isinstance(value, list) and len(value) == 1:
        value = value[0]
    if not isinstance(value, str):
        raise PydanticCustomError(
            "prompt_type",
            "must be a string (or an array of one): one prompt per request, and token-id "
            "prompts are not served",
        )
    return value


class ChatMessage(_Strict):
    """One message of a Chat Completions request."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Annotated[list[TextPart] | None, BeforeValidator(_text_or_parts)] = None
    name: Annotated[JsonValue, _refuse("names are not passed to the chat template")] = None
    tool_calls: _PASS = None
    tool_call_id: _PASS = None
    function_call: _FUNCTIONS = None
    refusal: Annotated[JsonValue, _refuse("refusals are not part of the chat template")] = None
    audio: Annotated[JsonValue, _refuse("no audio")] = None

    def text(self) -> str | None:
        return None if self.content is None else "\n".join(part.text for part in self.content)

    def to_native(self) -> dict[str, Any]:
        """The sluice message this one is (its tool fields checked as sluice checks them)."""
        out: dict[str, Any] = {
            "role": "system" if self.role == "developer" else self.role,
            "content": self.text(),
        }
        if self.tool_calls is not None:
            out["tool_calls"] = self.tool_calls
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out


class StreamOptions(_Strict):
    include_usage: bool | None = None  # usage is always on the last chunk
    continuous_usage_stats: Annotated[
        JsonValue, _refuse("usage is sent on the last chunk only")
    ] = None


class _OpenAIRequest(_Strict):
    model: str = Field(min_length=1)
    stop: Annotated[list[str] | None, BeforeValidator(_listed)] = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    user: str | None = None

    temperature: _PASS = None
    top_p: _PASS = None
    n: _PASS = None
    seed: _PASS = None
    presence_penalty: _PASS = None
    frequency_penalty: _PASS = None
    max_tokens: _PASS = None
    metadata: _PASS = None
    top_k: _PASS = None
    min_p: _PASS = None
    repetition_penalty: _PASS = None
    ignore_eos: _PASS = None
    stop_token_ids: _PASS = None
    skip_special_tokens: _PASS = None
    schema_version: _PASS = None
    request_id: _PASS = None
    session_id: _PASS = None
    tenant: _PASS = None
    reply_topic: _PASS = None
    priority: _PASS = None
    deadline: _PASS = None
    event_format: _PASS = None
    response_format: _PASS = None

    logit_bias: Annotated[JsonValue, _refuse("no logit bias")] = None
    service_tier: Annotated[
        JsonValue, _refuse("no service tiers (use priority)", ("auto", "default"))
    ] = None
    store: Annotated[JsonValue, _refuse("completions are not stored")] = None
    safety_identifier: Annotated[JsonValue, _refuse("no abuse monitoring")] = None
    prompt_cache_key: Annotated[
        JsonValue, _refuse("prefix caching is automatic (session_id keeps a chat's)")
    ] = None

    def _common(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            name: getattr(self, name) for name in PASSTHROUGH if getattr(self, name) is not None
        }
        if self.stop is not None:
            out["stop"] = self.stop
        out["stream"] = bool(self.stream)
        out.setdefault("event_format", "openai")
        return out


class ChatCompletionRequest(_OpenAIRequest):
    """An OpenAI Chat Completions request (``POST /v1/chat/completions``'s body)."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS_LIMIT)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)

    tools: _PASS = None
    tool_choice: _PASS = None
    parallel_tool_calls: _PASS = None
    functions: _FUNCTIONS = None
    function_call: _FUNCTIONS = None
    audio: Annotated[JsonValue, _refuse("no audio")] = None
    modalities: Annotated[JsonValue, _refuse("text output only", (["text"],))] = None
    prediction: Annotated[JsonValue, _refuse("no predicted outputs")] = None
    reasoning_effort: Annotated[JsonValue, _refuse("no reasoning-effort setting")] = None
    verbosity: Annotated[JsonValue, _refuse("no verbosity setting")] = None
    web_search_options: Annotated[JsonValue, _refuse("no web search")] = None

    def to_native(self) -> dict[str, Any]:
        """The fields of the :class:`GenerateRequest` this request means."""
        out = self._common()
        out |= {n: getattr(self, n) for n in CHAT_PASSTHROUGH if getattr(self, n) is not None}
        out["messages"] = [m.to_native() for m in self.messages]
        if self.max_completion_tokens is not None:
            out["max_tokens"] = self.max_completion_tokens
        if self.logprobs:
            out["logprobs"] = self.top_logprobs or 0
        return out

    @model_validator(mode="after")
    def _consistent(self) -> ChatCompletionRequest:
        if self.max_completion_tokens is not None and self.max_tokens is not None:
            raise PydanticCustomError(
                "conflict",
                "give max_completion_tokens or max_tokens, not both",
                {"field": "max_completion_tokens"},
            )
        if self.top_logprobs and not self.logprobs:
            raise PydanticCustomError(
                "needs_logprobs", "needs logprobs: true", {"field": "top_logprobs"}
            )
        return self


class CompletionRequest(_OpenAIRequest):
    """An OpenAI (legacy) Completions request (``POST /v1/completions``'s body)."""

    prompt: Annotated[str, BeforeValidator(_one_prompt)]
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)

    suffix: Annotated[JsonValue, _refuse("no insertion (suffix)")] = None
    echo: Annotated[JsonValue, _refuse("the prompt is not echoed")] = None
    best_of: Annotated[JsonValue, _refuse("no best_of; use n", (1,))] = None

    def to_native(self) -> dict[str, Any]:
        """The fields of the :class:`GenerateRequest` this request means."""
        out = self._common()
        out["prompt"] = self.prompt
        if self.logprobs is not None:
            out["logprobs"] = self.logprobs
        return out


def openai_shape(obj: dict[str, Any]) -> type[ChatCompletionRequest | CompletionRequest] | None:
    """Which OpenAI request shape a JSON object is in, or None for sluice's own."""
    if "model" not in obj:
        return None
    return ChatCompletionRequest if "messages" in obj else CompletionRequest
