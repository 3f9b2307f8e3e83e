"""Tool calls on the real broker with the real model: requests with tools, from the official
`openai` client and in sluice's own shape, get calls whose arguments validate against their tool's
schema, streamed as OpenAI's chunk deltas or sluice's token events, finished with "tool_calls";
a session's next turn brings the call's result back to the model with the earlier turn's KV; and
with a reasoning parser, a completion's thinking streams apart from its answer, in both formats.

The default model (SmolLM2-135M) knows nothing of tools: its template does not render them, so
sluice describes them in the system message, and a call it must make (``required``, a named
function) is held to the tools' schemas by the grammar."""

from __future__ import annotations

import json
import re

import pytest
from jsonschema import Draft202012Validator
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from sluice.actors.tool_calls import call_id
from sluice.testing.openai_bodies import sent_by_client
from sluice.testing.pipeline_harness import (
    PipelineProcess,
    Watcher,
    collect,
    new_prefix,
    publish,
    request,
    settled_session,
)

pytestmark = pytest.mark.integration

WEATHER_ARGS = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 20},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
ADD_ARGS = {
    "type": "object",
    "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
    "required": ["a", "b"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "weather",
            "description": "The weather now in a city.",
            "parameters": WEATHER_ARGS,
        },
    },
    {
        "type": "function",
        "function": {"name": "add", "description": "Add two integers.", "parameters": ADD_ARGS},
    },
]
SCHEMAS = {"weather": WEATHER_ARGS, "add": ADD_ARGS}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def valid(call_name: str, arguments: str) -> bool:
    validator = Draft202012Validator(SCHEMAS[call_name])
    return not list(validator.iter_errors(json.loads(arguments)))


def openai_body(request_id: str, **params) -> tuple[bytes, bytes]:
    body = sent_by_client("chat", model="SmolLM2", messages=ASK, tools=TOOLS, **params)
    return request_id.encode(), json.dumps({**body, "request_id": request_id}).encode()


# A completion that thinks, then answers (SmolLM2 never thinks of itself: a grammar makes it).
THINKING = {
    "type": "grammar",
    "grammar": 'start: "<think>" THOUGHT "</think>" ANSWER\n'
    "THOUGHT: /[a-z][a-z ]{2,40}/\nANSWER: /[A-Z][a-z ]{2,30}\\./",
}


async def test_tool_calls_over_kafka_in_both_event_formats(bootstrap_servers, redis_url, tmp_path):
    prefix = new_prefix()
    process = PipelineProcess(
        bootstrap_servers, redis_url, prefix, tmp_path, "--reasoning-parser", "qwen3"
    )
    named = {"type": "function", "function": {"name": "weather"}}
    trip = f"trip-{prefix}"  # (sessions live in the shared Redis)
    try:
        process.wait_ready()
        await publish(
            bootstrap_servers,
            f"{prefix}.requests",
            [
                openai_body(
                    "oa-stream", tool_choice="required", stream=True, temperature=0, max_tokens=60
                ),
                openai_body("oa-named", tool_choice=named, temperature=0, max_tokens=60),
                request(
                    "native",
                    messages=ASK,
                    tools=TOOLS,
                    tool_choice="required",
                    parallel_tool_calls=False,
                    temperature=0.8,
                    seed=11,
                    max_tokens=60,
                    session_id=trip,
                ),
            ]
            + [
                request(
                    f"thinks-{shape}",
                    messages=[{"role": "user", "content": "Is the sky blue?"}],
                    response_format=THINKING,
                    stream=True,
                    event_format=shape,
                    temperature=0,
                    max_tokens=60,
                )
                for shape in ("sluice", "openai")
            ],
        )
        asked = {"oa-stream", "oa-named", "native", "thinks-sluice", "thinks-openai"}
        streams = await collect(bootstrap_servers, prefix, asked)
        await settled_session(redis_url, "", trip, 1)  # (the default tenant's key)
        native = streams.events["native"]
        (call,) = native[-1]["tool_calls"]
        # the next turn: the call's result, and an answer in words (no more calls)
        result = {"role": "tool", "tool_call_id": call["id"], "content": "Sunny, 21 degrees."}
        await publish(
            bootstrap_servers,
            f"{prefix}.requests",
            [
                request(
                    "native-2",
                    messages=[result],
                    tools=TOOLS,
                    tool_choice="none",
                    temperature=0,
                    max_tokens=12,
                    session_id=trip,
                )
            ],
        )
        after = await collect(bootstrap_servers, prefix, {"native-2"})
    finally:
        process.stop()

    # OpenAI's chunks, streamed: the calls arrive as deltas, the last chunk says tool_calls
    chunks = [ChatCompletionChunk.model_validate(e) for e in streams.events["oa-stream"]]
    deltas = [d for c in chunks[:-1] for d in c.choices[0].delta.tool_calls or []]
    assert deltas and chunks[-1].choices[0].finish_reason == "tool_calls"
    assert [d.index for d in deltas] == list(range(len(deltas)))
    assert all(d.function and d.function.name in SCHEMAS for d in deltas)
    assert all(valid(d.function.name, d.function.arguments or "") for d in deltas if d.function)
    assert all(d.id and d.id.startswith("call_") for d in deltas)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == ""

    # OpenAI's whole object, a named function: one call of it, no content
    (whole,) = streams.events["oa-named"]
    completion = ChatCompletion.model_validate(whole)
    choice = completion.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (named_call,) = choice.message.tool_calls or []
    assert named_call.type == "function" and named_call.function.name == "weather"
    assert valid("weather", named_call.function.arguments)

    # sluice's events: token events carry each call as it completes, the final all of them
    streamed = [c for e in native if e["type"] == "token" for c in e.get("tool_calls") or []]
    final = native[-1]
    assert final["type"] == "final" and final["finish_reason"] == "tool_calls"
    assert streamed == final["tool_calls"] and final["text"] == ""
    assert valid(call["function"]["name"], call["function"]["arguments"])

    # the thinking apart from the answer: streamed as deltas of their own, whole on the final
    thought = streams.events["thinks-sluice"]
    final = thought[-1]
    assert final["type"] == "final" and final["finish_reason"] == "stop", final
    assert re.fullmatch(r"[a-z][a-z ]*", final["reasoning"]), final
    assert re.fullmatch(r"[A-Z][a-z ]*\.", final["text"]), final
    tokens = [e for e in thought if e["type"] == "token"]
    assert "".join(e.get("reasoning") or "" for e in tokens) == final["reasoning"]
    assert "".join(e["text"] for e in tokens) == final["text"]
    chunks = [ChatCompletionChunk.model_validate(e) for e in streams.events["thinks-openai"]]
    said = [c.choices[0].delta for c in chunks[:-1]]
    reasoning = "".join((d.model_extra or {}).get("reasoning") or "" for d in said)
    assert re.fullmatch(r"[a-z][a-z ]*", reasoning), said
    assert re.fullmatch(r"[A-Z][a-z ]*\.", "".join(d.content or "" for d in said)), said

    # the session's next turn: the result read by the model after the earlier turn's KV
    (answer,) = after.finals("native-2")
    assert answer["finish_reason"] in ("stop", "length") and answer["text"]
    assert "tool_calls" not in answer or answer["tool_calls"] is None
    assert answer["usage"]["cached_tokens"] > 0


async def test_a_call_cut_by_a_sigkill_is_finished_by_the_resumed_stream(
    bootstrap_servers, tmp_path
):
    """Killed while the model writes a long call (its text held back, as a call's text is): the
    resumed stream goes on from the tokens published before the kill, and its events carry the
    one call, whole, under the id an uninterrupted stream gives it."""
    prefix = new_prefix()
    rid = "call-resumed"
    note = {
        "type": "function",
        "function": {
            "name": "note",
            "description": "Keep a long note.",
            "parameters": {
                "type": "object",
                "properties": {"text": {"type": "string", "minLength": 300, "maxLength": 400}},
                "required": ["text"],
                "additionalProperties": False,
            },
        },
    }
    body = request(
        rid,
        messages=[{"role": "user", "content": "Write a long note about rivers."}],
        tools=[note],
        tool_choice={"type": "function", "function": {"name": "note"}},
        temperature=0.8,
        seed=5,
        max_tokens=400,
    )
    processes = [PipelineProcess(bootstrap_servers, None, prefix, tmp_path, name="first")]
    try:
        processes[0].wait_ready()
        async with Watcher(bootstrap_servers, prefix) as watcher:
            await publish(bootstrap_servers, f"{prefix}.requests", [body])
            await watcher.wait_for(lambda s: len(s.events[rid]) >= 12, 240, "12 token events")
            processes[0].kill()
            await watcher.caught_up()
            before = {e["seq"]: e for e in watcher.streams.events[rid] if e["type"] == "token"}
            assert not watcher.streams.finals(rid)  # killed mid-call
            assert not any(e.get("tool_calls") for e in before.values())  # (the call still open)
            processes.append(
                PipelineProcess(bootstrap_servers, None, prefix, tmp_path, name="after-kill")
            )
            processes[1].wait_ready()
            streams = await watcher.wait_finals({rid}, timeout=300)
    finally:
        for process in processes:
            process.kill()

    events = streams.events[rid]
    by_seq: dict[int, dict] = {}
    for event in (e for e in events if e["type"] == "token"):
        first = by_seq.setdefault(event["seq"], event)
        assert first == event, f"seq {event['seq']} published with two contents"
    assert all(by_seq[s] == e for s, e in before.items())  # what was out stays as it was
    final = next(e for e in events if e["type"] == "final")
    assert final["finish_reason"] == "tool_calls", final
    streamed = [c for s in sorted(by_seq) for c in by_seq[s].get("tool_calls") or []]
    (call,) = final["tool_calls"]
    assert streamed == [call] and call["id"] == call_id(rid, 0, 0)
    assert call["function"]["name"] == "note"
    text = json.loads(call["function"]["arguments"])["text"]
    assert 300 <= len(text) <= 400
    assert "".join(by_seq[s]["text"] for s in sorted(by_seq)) == final["text"] == ""
