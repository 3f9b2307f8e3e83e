"""OpenAI-shaped requests: the bodies the official `openai` client sends are read as sluice
requests with every field mapped, and what sluice does not serve is refused by name."""

from __future__ import annotations

import json
from typing import Any

import pytest

from sluice.schemas import GenerateRequest, RequestRejected, decode_request
from sluice.schemas.openai_request import (
    PASSTHROUGH,
    ChatCompletionRequest,
    CompletionRequest,
)
from sluice.testing.openai_bodies import sent_by_client


def decoded(body: dict[str, Any]) -> GenerateRequest:
    return decode_request(json.dumps(body).encode())


def rejected(body: dict[str, Any]) -> RequestRejected:
    with pytest.raises(RequestRejected) as info:
        decode_request(json.dumps(body).encode())
    return info.value


def test_a_chat_request_from_the_openai_client_maps_every_field():
    body = sent_by_client(
        "chat",
        model="SmolLM2-135M-Instruct",
        messages=[
            {"role": "developer", "content": "Be brief."},
            {
                "role": "user",
                "content": [{"type": "text", "text": "Hi."}, {"type": "text", "text": "Go."}],
            },
            {"role": "assistant", "content": "Hello."},
            {"role": "user", "content": "Again."},
        ],
        max_completion_tokens=12,
        temperature=0.5,
        top_p=0.9,
        n=2,
        seed=7,
        stop="END",
        presence_penalty=0.25,
        frequency_penalty=-0.5,
        logprobs=True,
        top_logprobs=3,
        stream=True,
        stream_options={"include_usage": True},
        user="someone",
        metadata={"ticket": "42"},
        service_tier="auto",
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "colours", "schema": {"type": "array"}, "strict": True},
        },
        extra_body={"top_k": 5, "min_p": 0.05, "request_id": "chat-1", "session_id": "s-1"},
    )
    request = decoded(body)
    assert request.messages is not None
    assert [(m.role, m.content) for m in request.messages] == [
        ("system", "Be brief."),
        ("user", "Hi.\nGo."),
        ("assistant", "Hello."),
        ("user", "Again."),
    ]
    assert (request.request_id, request.session_id) == ("chat-1", "s-1")
    assert request.max_tokens == 12 and request.n == 2 and request.seed == 7
    assert (request.temperature, request.top_p, request.top_k, request.min_p) == (0.5, 0.9, 5, 0.05)
    assert (request.presence_penalty, request.frequency_penalty) == (0.25, -0.5)
    assert request.stop == ["END"] and request.logprobs == 3
    assert request.stream is True and request.event_format == "openai"
    assert request.metadata == {"ticket": "42"}
    assert request.sampling_kwargs()["response_format"] == {
        "type": "json_schema",
        "json_schema": {"name": "colours", "schema": {"type": "array"}, "strict": True},
    }


def test_a_completions_request_from_the_openai_client():
    body = sent_by_client(
        "completions",
        model="m",
        prompt="Once upon a time",
        max_tokens=5,
        logprobs=2,
        stop=["\n", "."],
        echo=False,
        best_of=1,
    )
    request = decoded(body)
    assert request.prompt == "Once upon a time" and request.messages is None
    assert request.max_tokens == 5 and request.logprobs == 2 and request.stop == ["\n", "."]
    # OpenAI's default is no streaming: one object at the end
    assert request.stream is False and request.event_format == "openai"


WEATHER = {
    "type": "function",
    "function": {
        "name": "weather",
        "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


def test_a_chat_with_tools_from_the_openai_client_keeps_its_tools_calls_and_results():
    call = {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": "{}"}}
    body = sent_by_client(
        "chat",
        model="m",
        messages=[
            {"role": "user", "content": "Weather in Oslo?"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_1", "content": "rain"},
        ],
        tools=[WEATHER],
        tool_choice={"type": "function", "function": {"name": "weather"}},
        parallel_tool_calls=False,
    )
    request = decoded(body)
    assert request.tools is not None and request.tools[0].function.name == "weather"
    assert request.tool_choice is not None and not isinstance(request.tool_choice, str)
    assert request.tool_choice.function.name == "weather"
    assert request.parallel_tool_calls is False
    assert request.messages is not None
    assistant, tool = request.messages[1:]
    assert assistant.content is None and assistant.tool_calls is not None
    assert assistant.tool_calls[0].function.arguments == "{}"
    assert tool.role == "tool" and tool.tool_call_id == "call_1" and tool.content == "rain"
    # a Completions request has no tools
    assert rejected({"model": "m", "prompt": "x", "tools": [WEATHER]}).event.field == "tools"


def test_nulls_mean_absent_and_the_request_may_ask_for_sluice_events():
    request = decoded(
        {
            "model": "m",
            "messages": [{"role": "user", "content": "x"}],
            "temperature": None,
            "stop": None,
            "tools": None,
            "event_format": "sluice",
        }
    )
    assert request.temperature == 1.0 and request.stop == []
    assert request.event_format == "sluice"
    without_logprobs = decoded({"model": "m", "messages": [{"role": "user", "content": "x"}]})
    assert without_logprobs.logprobs is None


@pytest.mark.parametrize(
    "extra, field, reason",
    [
        ({"functions": [{"name": "f"}]}, "functions", "use tools"),
        ({"tool_choice": "required"}, "tool_choice", "needs tools"),
        (
            {
                "tools": [{"type": "function", "function": {"name": "f"}}],
                "tool_choice": {"type": "function", "function": {"name": "g"}},
            },
            "tool_choice",
            "not one of the tools",
        ),
        ({"response_format": {"type": "xml"}}, "response_format", "'json_schema'"),
        ({"logit_bias": {"50256": -100}}, "logit_bias", "logit bias"),
        ({"store": True}, "store", "not stored"),
        ({"max_tokenz": 3}, "max_tokenz", "did you mean 'max_tokens'"),
        ({"max_tokens": 3, "max_completion_tokens": 3}, "max_completion_tokens", "not both"),
        ({"top_logprobs": 2}, "top_logprobs", "logprobs: true"),
        ({"top_logprobs": 21, "logprobs": True}, "top_logprobs", "<= 20"),
        ({"n": 17}, "n", "<= 16"),
        ({"temperature": -1}, "temperature", ">= 0"),
        ({"stop": ""}, "stop.0", "must not be empty"),
        ({"model": ""}, "model", "must not be empty"),
    ],
)
def test_what_sluice_does_not_serve_is_refused_by_name(extra, field, reason):
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}], "request_id": "r-1"}
    error = rejected({**body, **extra})
    assert error.event.field == field
    assert reason in error.event.message
    # the error can still reach the client: its id was read, and it wants OpenAI's objects
    assert error.event.request_id == "r-1" and error.event_format == "openai"


@pytest.mark.parametrize(
    "message, field, reason",
    [
        (
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]},
            "messages.0.content.0",
            "image_url parts",
        ),
        ({"role": "user", "content": 3}, "messages.0.content", "a string or an array"),
        ({"role": "user", "content": "x", "tool_call_id": "c1"}, "messages.0.tool_call_id", "tool"),
        ({"role": "assistant"}, "messages.0.content", "tool_calls"),
        ({"role": "user", "content": "x", "name": "ann"}, "messages.0.name", "names"),
        ({"role": "robot", "content": "x"}, "messages.0.role", "must be one of"),
    ],
)
def test_bad_messages_are_refused_with_their_path(message, field, reason):
    error = rejected({"model": "m", "messages": [message]})
    assert error.event.field == field and reason in error.event.message


def test_completions_take_one_prompt_and_refuse_the_rest():
    assert decoded({"model": "m", "prompt": ["just one"]}).prompt == "just one"
    for prompt in (["a", "b"], [1, 2, 3], [[1, 2]]):
        assert rejected({"model": "m", "prompt": prompt}).event.field == "prompt"
    assert rejected({"model": "m"}).event.message == "prompt: field required"
    assert rejected({"model": "m", "prompt": "x", "echo": True}).event.field == "echo"
    assert rejected({"model": "m", "prompt": "x", "suffix": "y"}).event.field == "suffix"


def test_sluice_requests_are_not_read_as_openai_ones():
    native = decoded({"prompt": "x", "max_tokens": 2})
    assert native.event_format is None and native.stream is True
    # a native request naming OpenAI-only fields gets the native schema's answer
    assert "unknown field" in rejected({"prompt": "x", "max_completion_tokens": 2}).event.message


def test_every_passed_through_field_is_declared_and_is_a_sluice_field():
    for name in PASSTHROUGH:
        assert name in GenerateRequest.model_fields
        assert name in ChatCompletionRequest.model_fields
        assert name in CompletionRequest.model_fields
