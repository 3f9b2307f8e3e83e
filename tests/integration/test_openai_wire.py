"""The OpenAI wire on the real broker with the real model: bodies built by the official `openai`
client go in on the requests topic, and what comes out parses as the `openai` package's own types
and says what sluice's own events say for the same request.

One `sluice run --event-format openai` serves every case: OpenAI-shaped requests (streamed, not
streamed, Completions, structured, refused), a sluice request that asks for sluice events (the
reference), one that says nothing (so the pipeline's default applies); and
examples/openai_chunks.py."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from jsonschema import Draft202012Validator
from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from sluice.testing.openai_bodies import sent_by_client
from sluice.testing.pipeline_harness import PipelineProcess, collect, new_prefix, publish

pytestmark = pytest.mark.integration

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "openai_chunks.py"

COLOURS = {
    "type": "object",
    "properties": {
        "colours": {
            "type": "array",
            "items": {"enum": ["red", "green", "blue", "yellow"]},
            "minItems": 1,
            "maxItems": 3,
        },
        "favourite": {"type": "string", "maxLength": 12},
    },
    "required": ["colours", "favourite"],
    "additionalProperties": False,
}
CHAT = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "Name three colours."},
]


def message(request_id: str, body: dict) -> tuple[bytes, bytes]:
    return request_id.encode(), json.dumps({**body, "request_id": request_id}).encode()


def chat_body(**params) -> dict:
    return sent_by_client(
        "chat", model="SmolLM2-135M-Instruct", messages=CHAT, temperature=0, **params
    )


async def test_openai_requests_and_events_on_the_real_pipeline(bootstrap_servers, tmp_path):
    prefix = new_prefix()
    process = PipelineProcess(bootstrap_servers, None, prefix, tmp_path, "--event-format", "openai")
    streamed = chat_body(max_completion_tokens=8, logprobs=True, top_logprobs=2, stream=True)
    reference = {
        "messages": CHAT,
        "temperature": 0,
        "max_tokens": 8,
        "logprobs": 2,
        "event_format": "sluice",
    }
    completions = sent_by_client(
        "completions", model="SmolLM2", prompt="The capital of France is", max_tokens=5
    )
    refused = chat_body(functions=[{"name": "lookup"}])
    structured = chat_body(
        max_completion_tokens=120,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "colours", "schema": COLOURS, "strict": True},
        },
    )
    try:
        process.wait_ready()
        await publish(
            bootstrap_servers,
            f"{prefix}.requests",
            [
                message("oa-chat", streamed),
                message("native-chat", reference),
                message("native-default", {"prompt": "Once upon a time", "max_tokens": 4}),
                message("oa-text", completions),
                message("oa-refused", refused),
                message("oa-json", structured),
            ],
        )
        ids = {"oa-chat", "native-chat", "native-default", "oa-text", "oa-refused", "oa-json"}
        streams = await collect(bootstrap_servers, prefix, ids, timeout=240)
        # the same chat again, not streamed: one object, its prompt from the prefix cache
        await publish(
            bootstrap_servers,
            f"{prefix}.requests",
            [message("oa-whole", chat_body(max_completion_tokens=8))],
        )
        again = await collect(bootstrap_servers, prefix, {"oa-whole"}, timeout=240)
        example = subprocess.run(
            [sys.executable, str(EXAMPLE), "Name a colour.", "--max-tokens", "6"]
            + ["--bootstrap-servers", bootstrap_servers, "--topic-prefix", prefix],
            capture_output=True,
            text=True,
            timeout=120,
        )
    finally:
        process.stop()
    events = streams.events

    # streamed Chat Completions: chunks, in seq order, the role once, usage on the last
    chunks = [ChatCompletionChunk.model_validate(e) for e in events["oa-chat"]]
    assert [c.seq for c in chunks] == list(range(len(chunks)))  # type: ignore[attr-defined]
    assert {c.id for c in chunks} == {"chatcmpl-oa-chat"}
    assert len({c.created for c in chunks}) == 1
    *tokens, last = chunks
    assert [c.choices[0].delta.role for c in tokens] == ["assistant"] + [None] * (len(tokens) - 1)
    content = "".join(c.choices[0].delta.content or "" for c in tokens)
    entries = [e for c in tokens for e in c.choices[0].logprobs.content]  # type: ignore[union-attr]
    assert last.choices[0].finish_reason == "length" and last.usage is not None
    assert last.usage.completion_tokens == 8 == len(entries)
    assert last.usage.total_tokens == last.usage.prompt_tokens + 8

    # ... and they say what sluice's own events say for the same greedy request
    native = events["native-chat"]
    assert content == "".join(e["text"] for e in native if e["type"] == "token")
    native_entries = [lp for e in native if e["type"] == "token" for lp in e["logprobs"]]
    assert [(e.token, e.bytes, e.logprob) for e in entries] == [
        (lp["token"], lp["bytes"], lp["logprob"]) for lp in native_entries
    ]
    assert all(len(e.top_logprobs) == 2 for e in entries)
    # the token strings spell the text
    spelled = b"".join(bytes(e.bytes or []) for e in entries).decode("utf-8", "replace")
    assert content and spelled.startswith(content)

    # not streamed: one chat.completion, the same text, the prompt's KV reused
    (whole,) = again.events["oa-whole"]
    completion = ChatCompletion.model_validate(whole)
    assert completion.choices[0].message.content == content
    assert completion.usage is not None and completion.usage.prompt_tokens_details is not None
    assert completion.usage.prompt_tokens_details.cached_tokens > 0

    # a Completions request, not streamed (OpenAI's default)
    (text,) = events["oa-text"]
    plain = Completion.model_validate(text)
    assert plain.object == "text_completion" and plain.id == "cmpl-oa-text"
    assert plain.choices[0].text and plain.usage is not None
    assert plain.usage.completion_tokens <= 5

    # a sluice request that does not choose: the pipeline's --event-format openai
    default = events["native-default"]
    assert {e["object"] for e in default} == {"text_completion"}
    assert "usage" in default[-1]

    # the example client prints the streamed reply and its usage line
    assert example.returncode == 0, example.stderr
    reply, usage_line = example.stdout.rstrip("\n").rsplit("\n", 1)
    assert reply.strip() and usage_line.startswith("[length: ")

    # structured output: the content is JSON that validates against the schema
    (answer,) = events["oa-json"]
    parsed = ChatCompletion.model_validate(answer)
    assert parsed.choices[0].finish_reason == "stop"
    content = json.loads(parsed.choices[0].message.content or "")
    assert list(Draft202012Validator(COLOURS).iter_errors(content)) == [], content

    # what sluice does not serve: OpenAI's error object, naming the field
    (error,) = events["oa-refused"]
    assert error["error"]["param"] == "functions" and error["error"]["code"] == "invalid_request"
    assert error["seq"] == 0
