"""sluice's events written as OpenAI's objects, for requests whose ``event_format`` is ``openai``.

One event in, one object out, so that ``seq`` keeps its meaning (drop a ``(request_id, seq)``
already seen): a token event becomes a ``chat.completion.chunk`` (a ``text_completion`` chunk for a
Completions-style prompt) whose choice carries the text delta, the token ids and the logprobs with
token strings; the final event becomes the last chunk, with every completion's ``finish_reason``
and the ``usage`` (``total_tokens``, ``prompt_tokens_details.cached_tokens``); a request that
asked for no streaming gets one ``chat.completion`` (or ``text_completion``) object instead. An
error event becomes OpenAI's ``{"error": {...}}``. sluice's own fields ride along as extra fields
(OpenAI clients ignore them): ``request_id`` and ``seq`` at the top, and under ``sluice`` the
``session_id``, ``metadata`` and, on the last object, ``stop_reason``, ``timings``, ``seed``,
``provenance`` and ``failure``.

``id`` is ``chatcmpl-<request_id>`` (``cmpl-`` for Completions) and ``created`` the unix second
the request was published, so a request served again after a crash says the same.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from .events import (
    ErrorCode,
    ErrorEvent,
    FinalEvent,
    GeneratedToolCall,
    TokenEvent,
    TokenLogprob,
    Usage,
)


def wants_openai(asked: str | None, default: str) -> bool:
    """Whether a request's events are OpenAI's: its own event_format, else the pipeline's."""
    return (asked or default) == "openai"


@dataclass(frozen=True)
class OpenAIShape:
    """What a request's OpenAI objects need that its events do not carry."""

    chat: bool  # Chat Completions objects; else Completions (text_completion)
    created: int  # unix seconds
    model: str

    def head(self, request_id: str, kind: str) -> dict[str, Any]:
        return {
            "id": ("chatcmpl-" if self.chat else "cmpl-") + request_id,
            "object": kind,
            "created": self.created,
            "model": self.model,
        }

    @property
    def chunk_kind(self) -> str:
        return "chat.completion.chunk" if self.chat else "text_completion"

    @property
    def whole_kind(self) -> str:
        return "chat.completion" if self.chat else "text_completion"


def _chat_logprobs(entries: list[TokenLogprob]) -> dict[str, Any]:
    return {
        "content": [
            {
                "token": e.token or "",
                "logprob": e.logprob,
                "bytes": e.bytes,
                "top_logprobs": [
                    {"token": t.token or "", "logprob": t.logprob, "bytes": t.bytes} for t in e.top
                ],
            }
            for e in entries
        ],
        "refusal": None,
    }


def _completion_logprobs(entries: list[TokenLogprob]) -> dict[str, Any]:
    return {
        "tokens": [e.token or "" for e in entries],
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": [{t.token or "": t.logprob for t in e.top} for e in entries],
    }


def _logprobs(shape: OpenAIShape, entries: list[TokenLogprob] | None) -> dict[str, Any] | None:
    if entries is None:
        return None
    return _chat_logprobs(entries) if shape.chat else _completion_logprobs(entries)


def _usage(usage: Usage) -> dict[str, Any]:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.total_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
    }


def _extras(
    event: TokenEvent | FinalEvent | ErrorEvent, more: dict[str, Any] | None = None
) -> dict[str, Any]:
    """sluice's fields: the two that tell copies apart at the top, the rest under "sluice"."""
    out: dict[str, Any] = {"request_id": event.request_id, "seq": event.seq}
    own = {"session_id": event.session_id, "metadata": event.metadata, **(more or {})}
    own = {key: value for key, value in own.items() if value is not None}
    if own:
        out["sluice"] = own
    return out


def token_chunk(event: TokenEvent, shape: OpenAIShape, first: bool) -> dict[str, Any]:
    """A token event as a chunk; ``first``: the first of its completion (it names the role)."""
    choice: dict[str, Any] = {"index": event.index}
    if shape.chat:
        role = {"role": "assistant"} if first else {}
        choice["delta"] = role | {"content": event.text}
        if event.reasoning:  # (vLLM's name for it)
            choice["delta"]["reasoning"] = event.reasoning
        if event.tool_calls:
            choice["delta"]["tool_calls"] = [c.model_dump() for c in event.tool_calls]
    else:
        choice["text"] = event.text
    choice["logprobs"] = _logprobs(shape, event.logprobs)
    choice["finish_reason"] = None
    choice["token_ids"] = event.token_ids
    return shape.head(event.request_id, shape.chunk_kind) | {"choices": [choice]} | _extras(event)


def _outcomes(
    event: FinalEvent,
) -> list[tuple[int, str, str, list[GeneratedToolCall] | None, str | None]]:
    """(index, text, finish_reason, tool calls, reasoning) of every completion."""
    if event.choices:
        return [
            (c.index, c.text, c.finish_reason, c.tool_calls, c.reasoning) for c in event.choices
        ]
    return [(0, event.text, event.finish_reason, event.tool_calls, event.reasoning)]


def _final_extras(event: FinalEvent) -> dict[str, Any]:
    more = {
        "stop_reason": event.stop_reason,
        "timings": event.timings.model_dump(exclude_none=True),
        "seed": event.seed,
        "provenance": event.provenance.model_dump(exclude_none=True) if event.provenance else None,
        "failure": event.error.model_dump() if event.error is not None else None,
    }
    return _extras(event, more)


def last_chunk(event: FinalEvent, shape: OpenAIShape) -> dict[str, Any]:
    """The final event as the stream's last chunk: how each completion ended, and the usage."""
    choices = []
    for index, _, finish_reason, _, _ in _outcomes(event):
        choice: dict[str, Any] = {"index": index}
        if shape.chat:
            choice["delta"] = {}
        else:
            choice["text"] = ""
        choices.append(choice | {"logprobs": None, "finish_reason": finish_reason})
    body = {"choices": choices, "usage": _usage(event.usage)}
    return shape.head(event.request_id, shape.chunk_kind) | body | _final_extras(event)


def whole(
    event: FinalEvent, shape: OpenAIShape, logprobs: dict[int, list[TokenLogprob]] | None
) -> dict[str, Any]:
    """The final event as one completion object (the request asked for no streaming)."""
    choices = []
    for index, text, finish_reason, calls, reasoning in _outcomes(event):
        choice: dict[str, Any] = {"index": index}
        if shape.chat:
            choice["message"] = {
                "role": "assistant",
                "content": text if text or not calls else None,
                "refusal": None,
            }
            if reasoning:
                choice["message"]["reasoning"] = reasoning
            if calls:  # (OpenAI's calls have no index: their order is it)
                choice["message"]["tool_calls"] = [c.model_dump(exclude={"index"}) for c in calls]
        else:
            choice["text"] = text
        entries = None if logprobs is None else logprobs.get(index, [])
        choices.append(
            choice | {"logprobs": _logprobs(shape, entries), "finish_reason": finish_reason}
        )
    body = {"choices": choices, "usage": _usage(event.usage)}
    return shape.head(event.request_id, shape.whole_kind) | body | _final_extras(event)


_ERROR_TYPES: dict[str, str] = {
    ErrorCode.INTERNAL.value: "server_error",
    ErrorCode.OVERLOADED.value: "server_error",
    ErrorCode.DEADLINE_EXCEEDED.value: "timeout",
}


def error_object(event: ErrorEvent) -> dict[str, Any]:
    """An error event as OpenAI's error object (sluice's code is its ``code``)."""
    error = {
        "message": event.message,
        "type": _ERROR_TYPES.get(event.code, "invalid_request_error"),
        "param": event.field,
        "code": event.code,
    }
    return {"error": error} | _extras(event)


def dump(obj: dict[str, Any]) -> bytes:
    """Compact UTF-8 JSON, as every event is sent."""
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
