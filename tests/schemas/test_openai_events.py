"""sluice's events as OpenAI objects: whatever the event, the object parses as the official
`openai` package's type for it and says what the event says."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st
from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from openai.types.shared import ErrorObject

from sluice.schemas import ErrorEvent, FinalEvent, TokenEvent
from sluice.schemas.openai_events import (
    OpenAIShape,
    dump,
    error_object,
    last_chunk,
    token_chunk,
    whole,
)

from .strategies import error_events, final_events, token_events

CHAT = OpenAIShape(chat=True, created=1_700_000_000, model="SmolLM2")
PLAIN = OpenAIShape(chat=False, created=1_700_000_000, model="SmolLM2")
# OpenAI's finish reasons; sluice's abort and error (vLLM sends abort too) are beyond its types.
OPENAI_FINISHES = ("stop", "length")


def wire(obj: dict) -> dict:
    """What a consumer reads: the object through its bytes."""
    return json.loads(dump(obj))


@settings(max_examples=150, deadline=None)
@given(token_events, st.booleans())
def test_a_token_event_is_a_chat_completion_chunk(event: TokenEvent, first: bool):
    chunk = ChatCompletionChunk.model_validate(wire(token_chunk(event, CHAT, first)))
    assert chunk.id == f"chatcmpl-{event.request_id}" and chunk.object == "chat.completion.chunk"
    assert chunk.created == CHAT.created and chunk.model == CHAT.model
    (choice,) = chunk.choices
    assert choice.index == event.index and choice.finish_reason is None
    assert choice.delta.content == event.text
    assert choice.delta.role == ("assistant" if first else None)  # once: clients concatenate
    assert chunk.seq == event.seq and chunk.request_id == event.request_id  # type: ignore[attr-defined]
    if event.logprobs is None:
        assert choice.logprobs is None
    else:
        assert choice.logprobs is not None and choice.logprobs.content is not None
        entries = choice.logprobs.content
        assert [e.logprob for e in entries] == [lp.logprob for lp in event.logprobs]
        assert [e.token for e in entries] == [lp.token or "" for lp in event.logprobs]
        assert [e.bytes for e in entries] == [lp.bytes for lp in event.logprobs]
        assert [len(e.top_logprobs) for e in entries] == [len(lp.top) for lp in event.logprobs]


@settings(max_examples=100, deadline=None)
@given(token_events)
def test_a_token_event_is_a_text_completion_chunk(event: TokenEvent):
    obj = wire(token_chunk(event, PLAIN, first=True))
    assert obj["id"] == f"cmpl-{event.request_id}" and obj["object"] == "text_completion"
    assert obj["choices"][0]["finish_reason"] is None  # a chunk: not finished yet
    # openai's Completion type describes the whole object, whose choices have finished
    obj["choices"][0]["finish_reason"] = "stop"
    completion = Completion.model_validate(obj)
    assert completion.choices[0].text == event.text
    if event.logprobs is not None:
        logprobs = completion.choices[0].logprobs
        assert logprobs is not None
        assert logprobs.token_logprobs == [lp.logprob for lp in event.logprobs]


def finals_openai_knows():
    def fits(event: FinalEvent) -> bool:
        reasons = [event.finish_reason] + [c.finish_reason for c in event.choices or []]
        return all(r in OPENAI_FINISHES for r in reasons)

    return final_events.filter(fits)


@settings(max_examples=150, deadline=None)
@given(finals_openai_knows())
def test_a_final_event_is_the_last_chunk_with_usage(event: FinalEvent):
    chunk = ChatCompletionChunk.model_validate(wire(last_chunk(event, CHAT)))
    expected = [(c.index, c.finish_reason) for c in event.choices or []] or [
        (0, event.finish_reason)
    ]
    assert [(c.index, c.finish_reason) for c in chunk.choices] == expected
    assert all(c.delta.content is None for c in chunk.choices)
    usage = chunk.usage
    assert usage is not None and usage.prompt_tokens_details is not None
    assert usage.total_tokens == event.usage.prompt_tokens + event.usage.completion_tokens
    assert usage.prompt_tokens_details.cached_tokens == event.usage.cached_tokens
    assert chunk.seq == event.seq  # type: ignore[attr-defined]
    plain = Completion.model_validate(wire(last_chunk(event, PLAIN)))
    assert [c.finish_reason for c in plain.choices] == [r for _, r in expected]


@settings(max_examples=150, deadline=None)
@given(finals_openai_knows())
def test_a_final_event_of_a_request_that_did_not_stream_is_one_completion(event: FinalEvent):
    logprobs = {c.index: c.logprobs or [] for c in event.choices or []} or {0: event.logprobs or []}
    completion = ChatCompletion.model_validate(wire(whole(event, CHAT, logprobs)))
    assert completion.object == "chat.completion"
    texts = [(c.index, c.text) for c in event.choices or []] or [(0, event.text)]
    assert [(c.index, c.message.content) for c in completion.choices] == texts
    assert all(c.message.role == "assistant" for c in completion.choices)
    for choice in completion.choices:
        assert choice.logprobs is not None and choice.logprobs.content is not None
        assert len(choice.logprobs.content) == len(logprobs[choice.index])
    plain = Completion.model_validate(wire(whole(event, PLAIN, None)))
    assert [(c.index, c.text) for c in plain.choices] == texts
    assert all(c.logprobs is None for c in plain.choices)


@settings(max_examples=100, deadline=None)
@given(error_events)
def test_an_error_event_is_openais_error_object(event: ErrorEvent):
    obj = wire(error_object(event))
    error = ErrorObject.model_validate(obj["error"])
    assert error.message == event.message and error.code == event.code
    assert error.param == event.field
    assert error.type == ("server_error" if event.code == "internal" else error.type)


def test_tool_calls_are_chunk_deltas_and_the_whole_message_s_calls():
    call = {
        "index": 0,
        "id": "call_0123456789abcdef01234567",
        "function": {"name": "weather", "arguments": '{"city": "Oslo"}'},
    }
    event = TokenEvent.model_validate(
        {"request_id": "r", "seq": 2, "token_ids": [5, 6], "text": "", "tool_calls": [call]}
    )
    chunk = ChatCompletionChunk.model_validate(wire(token_chunk(event, CHAT, False)))
    (delta,) = chunk.choices[0].delta.tool_calls or []
    assert (delta.index, delta.id, delta.type) == (0, call["id"], "function")
    assert delta.function is not None and delta.function.name == "weather"
    assert delta.function.arguments == '{"city": "Oslo"}'
    final = FinalEvent.model_validate(
        {
            "request_id": "r",
            "seq": 3,
            "finish_reason": "tool_calls",
            "usage": {"prompt_tokens": 9, "completion_tokens": 2},
            "timings": {"queue_s": 0, "total_s": 1},
            "model": "m",
            "text": "",
            "tool_calls": [call],
        }
    )
    completion = ChatCompletion.model_validate(wire(whole(final, CHAT, None)))
    choice = completion.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (made,) = choice.message.tool_calls or []
    assert made.id == call["id"] and made.function.arguments == '{"city": "Oslo"}'
    last = ChatCompletionChunk.model_validate(wire(last_chunk(final, CHAT)))
    assert last.choices[0].finish_reason == "tool_calls"


def test_reasoning_is_the_deltas_and_the_messages_reasoning_apart_from_the_content():
    event = TokenEvent.model_validate(
        {"request_id": "r", "seq": 1, "token_ids": [7], "text": "", "reasoning": "Blue, "}
    )
    chunk = ChatCompletionChunk.model_validate(wire(token_chunk(event, CHAT, True)))
    delta = chunk.choices[0].delta
    assert delta.content == "" and (delta.model_extra or {})["reasoning"] == "Blue, "
    plain = ChatCompletionChunk.model_validate(
        wire(token_chunk(event.model_copy(update={"reasoning": None}), CHAT, True))
    )
    assert "reasoning" not in (plain.choices[0].delta.model_extra or {})
    final = FinalEvent.model_validate(
        {
            "request_id": "r",
            "seq": 3,
            "finish_reason": "stop",
            "usage": {"prompt_tokens": 9, "completion_tokens": 5},
            "timings": {"queue_s": 0, "total_s": 1},
            "model": "m",
            "text": "Yes.",
            "reasoning": "Blue, as ever.",
        }
    )
    message = ChatCompletion.model_validate(wire(whole(final, CHAT, None))).choices[0].message
    assert (
        message.content == "Yes." and (message.model_extra or {})["reasoning"] == "Blue, as ever."
    )
