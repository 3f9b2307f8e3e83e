"""JSON Schema export: complete, loadable as JSON, and agreeing with the models and the docs,
checked with the `jsonschema` package (draft 2020-12)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from hypothesis import given, settings
from jsonschema import Draft202012Validator

from sluice.schemas import (
    RequestRejected,
    decode_event,
    decode_request,
    encode,
    json_schemas,
)
from sluice.schemas.tool_messages import ToolCallMessage, ToolResultMessage

from .strategies import events, requests

DOCS = Path(__file__).resolve().parents[2] / "docs" / "SCHEMAS.md"
SCHEMAS = json_schemas()
VALIDATORS = {name: Draft202012Validator(schema) for name, schema in SCHEMAS.items()}


def errors(instance: object, name: str) -> list[str]:
    """Why `instance` does not satisfy the schema `name` (empty when it does)."""
    return [f"{e.json_path}: {e.message}" for e in VALIDATORS[name].iter_errors(instance)]


def is_valid(instance: object, name: str) -> bool:
    return not errors(instance, name)


def test_every_schema_is_a_valid_draft_2020_12_schema():
    for schema in SCHEMAS.values():
        Draft202012Validator.check_schema(schema)


TOOL_MESSAGES = {"ToolCallMessage": ToolCallMessage, "ToolResultMessage": ToolResultMessage}


def doc_examples() -> list[tuple[str, object]]:
    text = DOCS.read_text(encoding="utf-8")
    found = re.findall(r"<!-- example: (\w+) -->\s*```json\n(.*?)```", text, re.S)
    return [(name, json.loads(body)) for name, body in found]


def test_all_schemas_are_exported_as_plain_json():
    assert set(SCHEMAS) == {
        "GenerateRequest",
        "TokenEvent",
        "FinalEvent",
        "ErrorEvent",
        "OutputEvent",
        "ToolCallMessage",
        "ToolResultMessage",
        "HarnessRequest",
        "HarnessStep",
        "HarnessFinal",
        "HarnessDelta",
        "Approval",
    }
    for name, schema in SCHEMAS.items():
        assert json.loads(json.dumps(schema)) == schema
        assert schema["$schema"].endswith("2020-12/schema") and schema["title"] == name


def test_request_schema_forbids_unknown_fields_and_events_allow_them():
    assert SCHEMAS["GenerateRequest"]["additionalProperties"] is False
    for name in ("TokenEvent", "FinalEvent", "ErrorEvent"):
        assert "additionalProperties" not in SCHEMAS[name]
        assert SCHEMAS[name]["required"][:2] == ["schema_version", "type"]


def test_docs_have_examples_of_every_message():
    names = [name for name, _ in doc_examples()]
    assert {"GenerateRequest", "TokenEvent", "FinalEvent", "ErrorEvent", *TOOL_MESSAGES} <= set(
        names
    )


@pytest.mark.parametrize("name, example", doc_examples())
def test_docs_examples_validate_against_schema_and_model(name, example):
    assert errors(example, name) == []
    raw = json.dumps(example).encode()
    if name == "GenerateRequest":
        assert decode_request(raw).request_id == example["request_id"]
    elif name in TOOL_MESSAGES:
        assert TOOL_MESSAGES[name].model_validate_json(raw).key == example["key"]
    else:
        assert type(decode_event(raw)).__name__ == name
        assert is_valid(example, "OutputEvent")


def test_docs_error_examples_are_what_decode_request_produces():
    request = next(ex for name, ex in doc_examples() if name == "GenerateRequest")
    errors_in_docs = [ex for name, ex in doc_examples() if name == "ErrorEvent"]
    typo = dict(request)
    typo["max_token"] = typo.pop("max_tokens")
    with pytest.raises(RequestRejected) as info:
        decode_request(json.dumps(typo).encode())
    assert json.loads(encode(info.value.event)) == errors_in_docs[0]
    with pytest.raises(RequestRejected) as info:
        decode_request(b"hello")
    assert json.loads(encode(info.value.event)) == errors_in_docs[1]


@pytest.mark.parametrize(
    "bad",
    [
        {},
        {"prompt": "x", "messages": [{"role": "user", "content": "y"}]},
        {"prompt": ""},
        {"prompt": "x", "max_token": 1},
        {"prompt": "x", "max_tokens": 0},
        {"prompt": "x", "top_p": 0},
        {"prompt": "x", "schema_version": 2},
        {"prompt": "x", "ignore_eos": 1},
        {"prompt": "x", "reply_topic": ".."},
        {"prompt": "x", "session_id": "a b"},
        {"messages": [{"role": "bot", "content": "y"}]},
    ],
)
def test_request_schema_rejects_what_the_model_rejects(bad):
    assert not is_valid(bad, "GenerateRequest")
    with pytest.raises(RequestRejected):
        decode_request(json.dumps(bad).encode())


@settings(max_examples=200, deadline=None)
@given(requests())
def test_every_valid_request_satisfies_the_schema(req):
    assert errors(json.loads(encode(req)), "GenerateRequest") == []


@settings(max_examples=200, deadline=None)
@given(events)
def test_every_event_satisfies_its_schema(ev):
    wire = json.loads(encode(ev))
    assert errors(wire, type(ev).__name__) == []
    assert errors(wire, "OutputEvent") == []
