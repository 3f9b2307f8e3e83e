"""Bytes on a topic to messages and back.

``decode_request`` turns the bytes of one Kafka message into a :class:`GenerateRequest`, or raises
:class:`RequestRejected` carrying a ready-made :class:`ErrorEvent` to publish: bad input never
stops a partition, it becomes an error event.

* bytes that are not UTF-8, or not JSON (NaN and Infinity are not JSON) -> ``invalid_json``;
* a JSON value that is not an object -> ``invalid_request``;
* ``schema_version`` an integer other than a supported one -> ``unsupported_schema_version``;
* any other validation failure (missing, unknown, mistyped or out-of-range field) ->
  ``invalid_request``, with a message such as ``"max_tokens: must be >= 1 (got 0)"`` and the
  dotted path of the first bad field in ``field``.

An object with a ``model`` field is an OpenAI Chat Completions or Completions request
(``openai_request.py``): checked as that shape, then mapped onto ours and checked as ours.

The error event's ``request_id`` (and ``session_id``) are filled whenever they can be read from the
JSON, even if other fields are bad, so the error can go to the client's reply stream; when no
request id can be read, the event carries the raw bytes (base64) for the dead-letter topic.

Requests are strict (unknown fields rejected); events are lenient (unknown fields ignored, unknown
event types reported by :class:`UnknownEventType` so a consumer can skip them).
"""

from __future__ import annotations

import difflib
import json
from typing import Any

from pydantic import BaseModel, TypeAdapter, ValidationError
from pydantic_core import ErrorDetails

from .events import EVENT_TYPES, ErrorCode, ErrorEvent, OutputEvent
from .openai_request import ChatCompletionRequest, ChatMessage, CompletionRequest, openai_shape
from .request import (
    RESPONSE_FORMAT_TYPES,
    GenerateRequest,
    Message,
    _request_id,
    _session_id,
    _topic,
)
from .version import SCHEMA_VERSION, SUPPORTED_VERSIONS

MAX_ERRORS_IN_MESSAGE = 5
_GOT_LIMIT = 60


class RequestRejected(ValueError):
    """A message that is not a valid request; ``event`` is the error event to publish."""

    def __init__(
        self, event: ErrorEvent, reply_topic: str | None = None, event_format: str | None = None
    ) -> None:
        super().__init__(f"{event.code}: {event.message}")
        self.event = event
        self.reply_topic = reply_topic
        """The request's reply topic, when it could be read and is valid."""
        self.event_format = event_format
        """The event format the request asked for (openai for an OpenAI shape), if readable."""

    @property
    def code(self) -> str:
        return self.event.code


class UnknownEventType(ValueError):
    """An event whose ``type`` this version does not know (a consumer should skip it)."""

    def __init__(self, event_type: object) -> None:
        super().__init__(f"unknown event type {event_type!r}")
        self.event_type = event_type


class _NotJson(ValueError):
    pass


def _no_constants(name: str) -> Any:
    raise _NotJson(f"{name} is not valid JSON")


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """An object whose keys are all different: which of two values a client meant is unknown."""
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _NotJson(f"message is not JSON we accept: duplicate key {_utf8_safe(key)!r}")
        out[key] = value
    return out


def _as_bytes(raw: bytes | bytearray | memoryview | str) -> bytes:
    if isinstance(raw, str):
        return raw.encode("utf-8", "surrogatepass")
    return bytes(raw)


def _load_json(data: bytes) -> Any:
    """Parse strict JSON from UTF-8 bytes; raise ``_NotJson`` with a reason otherwise."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise _NotJson(f"message is not UTF-8 (invalid byte at offset {exc.start})") from None
    try:
        return json.loads(text, parse_constant=_no_constants, object_pairs_hook=_unique_keys)
    except json.JSONDecodeError as exc:
        raise _NotJson(
            f"message is not JSON: {exc.msg} at line {exc.lineno} column {exc.colno}"
        ) from None
    except RecursionError:
        raise _NotJson("message is not JSON we accept: nested too deeply") from None


def _json_kind(value: Any) -> str:
    if isinstance(value, list):
        return "an array"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if value is None:
        return "null"
    return "an object"


def _readable(obj: dict[str, Any], key: str, check: Any) -> str | None:
    value = obj.get(key)
    if not isinstance(value, str):
        return None
    try:
        return check(value)
    except ValueError:
        return None


def _got(value: Any) -> str:
    if not isinstance(value, (str, int, float, bool)) and value is not None:
        return ""
    try:
        text = json.dumps(value, ensure_ascii=False)
    except ValueError:  # nan / inf
        text = repr(value)
    if len(text) > _GOT_LIMIT:
        text = text[: _GOT_LIMIT - 1] + "…"
    return f" (got {_utf8_safe(text)})"


def _utf8_safe(text: str) -> str:
    """A lone surrogate (legal in a JSON escape, not in UTF-8) is shown escaped."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


_TYPE_REASONS = {
    "int_type": "must be an integer",
    "int_from_float": "must be an integer",
    "int_parsing": "must be an integer",
    "float_type": "must be a number",
    "float_parsing": "must be a number",
    "string_type": "must be a string",
    "string_unicode": "must be valid Unicode (a lone surrogate escape is not)",
    "bool_type": "must be true or false",
    "list_type": "must be an array",
    "dict_type": "must be an object",
    "model_type": "must be an object",
    "model_attributes_type": "must be an object",
    "finite_number": "must be a finite number",
    "missing": "field required",
}


def _reason(err: ErrorDetails, shape: type[BaseModel]) -> str:
    """The reason of one pydantic error, in the words of the wire format."""
    kind = err["type"]
    ctx = err.get("ctx") or {}
    if kind in _TYPE_REASONS:
        return _TYPE_REASONS[kind]
    if kind == "extra_forbidden":
        name = _utf8_safe(str(err["loc"][-1])) if err["loc"] else ""
        known = _known_fields(err["loc"][:-1], shape)
        close = difflib.get_close_matches(name, known, n=1)
        hint = f"; did you mean '{close[0]}'?" if close else ""
        where = f"schema version {SCHEMA_VERSION}"
        if shape in (ChatCompletionRequest, CompletionRequest):
            where = "the OpenAI request fields sluice reads"
        return f"unknown field (not in {where}){hint}"
    if kind == "greater_than_equal":
        return f"must be >= {ctx['ge']}"
    if kind == "greater_than":
        return f"must be > {ctx['gt']}"
    if kind == "less_than_equal":
        return f"must be <= {ctx['le']}"
    if kind == "less_than":
        return f"must be < {ctx['lt']}"
    if kind == "string_too_short":
        n = ctx.get("min_length", 1)
        return "must not be empty" if n == 1 else f"must be at least {n} characters"
    if kind == "string_too_long":
        return f"must be at most {ctx['max_length']} characters"
    if kind == "too_short":
        n = ctx.get("min_length", 1)
        return "must not be empty" if n == 1 else f"must have at least {n} items"
    if kind == "too_long":
        return f"must have at most {ctx['max_length']} items"
    if kind == "union_tag_invalid":
        name = str(ctx["discriminator"]).strip("'")
        return f"{name}: must be one of {ctx['expected_tags']} (got {ctx['tag']!r})"
    if kind in ("unsupported_field", "content_type", "prompt_type"):
        return str(err["msg"])
    if kind == "literal_error":
        return f"must be one of {ctx['expected']}"
    msg = str(err.get("msg", kind))
    return msg[:1].lower() + msg[1:]


def _known_fields(parent: tuple[Any, ...], shape: type[BaseModel]) -> list[str]:
    """Field names of the model at ``parent`` in ``shape`` (for 'did you mean' hints)."""
    if not parent:
        return list(shape.model_fields)
    if parent[0] == "messages":
        openai = shape in (ChatCompletionRequest, CompletionRequest)
        return list(ChatMessage.model_fields if openai else Message.model_fields)
    return []


def _field_of(err: ErrorDetails) -> str | None:
    loc = list(err["loc"])
    # a tagged union's errors name the tag after the field (response_format.regex.regex): not a
    # field of the client's message, so left out
    for i in range(len(loc) - 1, 0, -1):
        if loc[i - 1] == "response_format" and loc[i] in RESPONSE_FORMAT_TYPES:
            del loc[i]
    named = (err.get("ctx") or {}).get("field")  # by a check of the object at `loc`
    path = ".".join(str(p) for p in [*loc, *([named] if named else [])])
    return _utf8_safe(path) if path else None


def error_from_validation(
    exc: ValidationError, request_id: str | None, shape: type[BaseModel]
) -> ErrorEvent:
    """The error event of a message that `shape` refused: its first fields and reasons, in the
    words of the wire format (used for sluice's own requests, OpenAI's, and harness runs)."""
    errors = exc.errors(include_url=False)
    code = ErrorCode.INVALID_REQUEST
    parts = []
    for err in errors[:MAX_ERRORS_IN_MESSAGE]:
        if err["type"] == "unsupported_schema_version":
            code = ErrorCode.UNSUPPORTED_SCHEMA_VERSION
        field = _field_of(err)
        got = "" if err["type"] in ("missing", "extra_forbidden") else _got(err.get("input"))
        prefix = f"{field}: " if field else ""
        parts.append(f"{prefix}{_reason(err, shape)}{got}")
    if len(errors) > MAX_ERRORS_IN_MESSAGE:
        parts.append(f"and {len(errors) - MAX_ERRORS_IN_MESSAGE} more")
    return ErrorEvent(
        request_id=request_id,
        code=code,
        message="; ".join(parts),
        field=_field_of(errors[0]) if errors else None,
    )


def _reject(
    data: bytes,
    code: ErrorCode,
    message: str,
    *,
    field: str | None = None,
    obj: dict[str, Any] | None = None,
) -> RequestRejected:
    request_id = session_id = reply_topic = event_format = None
    if obj is not None:
        request_id = _readable(obj, "request_id", _request_id)
        session_id = _readable(obj, "session_id", _session_id)
        reply_topic = _readable(obj, "reply_topic", _topic)
        event_format = _event_format(obj)
    event = ErrorEvent(
        request_id=request_id, session_id=session_id, code=code, message=message, field=field
    )
    if event.request_id is None:  # goes to the dead-letter topic: keep the evidence
        event = event.with_raw(data)
    return RequestRejected(event, reply_topic, event_format)


def _event_format(obj: dict[str, Any]) -> str | None:
    """The event format a request asks for, as far as it can be read."""
    named = obj.get("event_format")
    if named in ("sluice", "openai"):
        return str(named)
    return "openai" if openai_shape(obj) is not None else None


def decode_request(raw: bytes | bytearray | memoryview | str) -> GenerateRequest:
    """Decode one message of the requests topic; raise :class:`RequestRejected` if it is bad."""
    data = _as_bytes(raw)
    try:
        obj = _load_json(data)
    except _NotJson as exc:
        raise _reject(data, ErrorCode.INVALID_JSON, str(exc)) from None
    if not isinstance(obj, dict):
        raise _reject(
            data,
            ErrorCode.INVALID_REQUEST,
            f"a request must be a JSON object, not {_json_kind(obj)}",
        )
    version = obj.get("schema_version", SCHEMA_VERSION)
    if (
        isinstance(version, int)
        and not isinstance(version, bool)
        and (version not in SUPPORTED_VERSIONS)
    ):
        supported = ", ".join(map(str, sorted(SUPPORTED_VERSIONS)))
        raise _reject(
            data,
            ErrorCode.UNSUPPORTED_SCHEMA_VERSION,
            f"schema_version: unsupported version {version}; this server speaks {supported}",
            field="schema_version",
            obj=obj,
        )
    shape: type[BaseModel] | None = openai_shape(obj)
    try:
        if shape is not None:  # mapped onto ours, then checked as ours
            obj = shape.model_validate(obj).to_native()  # type: ignore[attr-defined]
        shape = GenerateRequest
        return GenerateRequest.model_validate(obj)
    except ValidationError as exc:
        rejected = _reject(data, ErrorCode.INVALID_REQUEST, "", obj=obj)
        detail = error_from_validation(exc, rejected.event.request_id, shape or GenerateRequest)
        event = rejected.event.model_copy(
            update={"code": detail.code, "message": detail.message, "field": detail.field}
        )
        raise RequestRejected(event, rejected.reply_topic, rejected.event_format) from None


_EVENT_ADAPTER: TypeAdapter[Any] = TypeAdapter(OutputEvent)


def decode_event(raw: bytes | bytearray | memoryview | str) -> OutputEvent:
    """Decode one message of the tokens topic. Unknown fields are ignored; an unknown ``type``
    raises :class:`UnknownEventType`; anything else invalid raises ``ValueError``."""
    data = _as_bytes(raw)
    try:
        obj = _load_json(data)
    except _NotJson as exc:
        raise ValueError(str(exc)) from None
    if not isinstance(obj, dict):
        raise ValueError(f"an event must be a JSON object, not {_json_kind(obj)}")
    if obj.get("type") not in EVENT_TYPES:
        raise UnknownEventType(obj.get("type"))
    return _EVENT_ADAPTER.validate_python(obj)


def encode(message: BaseModel) -> bytes:
    """Serialize a request or an event to compact UTF-8 JSON; fields that are null are left out
    (an absent field and ``null`` mean the same on the wire)."""
    return message.model_dump_json(exclude_none=True).encode("utf-8")
