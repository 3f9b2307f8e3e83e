"""JSON Schema (draft 2020-12) of every wire message, for clients in any language.

``json_schemas()`` maps a name to a schema: ``GenerateRequest`` (what a client may send; it has
``additionalProperties: false`` because requests reject unknown fields), ``TokenEvent``,
``FinalEvent``, ``ErrorEvent`` (what sluice sends; open to new fields, which consumers ignore), and
``OutputEvent`` (any event, told apart by ``type``), and the messages of tool calls and their
results (``ToolCallMessage``, ``ToolResultMessage``) for tool workers in other languages, and the
harness's (``HarnessRequest``, ``HarnessStep``, ``HarnessDelta``, ``HarnessFinal``,
``Approval``: docs/HARNESS.md).
``sluice schema`` prints them.
"""

from __future__ import annotations

from typing import Any

from pydantic import TypeAdapter

from .events import ErrorEvent, FinalEvent, OutputEvent, TokenEvent
from .harness import Approval, HarnessDelta, HarnessFinal, HarnessRequest, HarnessStep
from .request import GenerateRequest
from .tool_messages import ToolCallMessage, ToolResultMessage
from .version import SCHEMA_VERSION

DIALECT = "https://json-schema.org/draft/2020-12/schema"


def _stamp(schema: dict[str, Any], name: str) -> dict[str, Any]:
    out = {"$schema": DIALECT, "$id": f"sluice/v{SCHEMA_VERSION}/{name}.json"}
    out.update(schema)
    out.setdefault("title", name)
    return out


def json_schemas() -> dict[str, dict[str, Any]]:
    """Name -> JSON Schema of the request (as accepted) and of each event (as sent)."""
    return {
        "GenerateRequest": _stamp(
            GenerateRequest.model_json_schema(mode="validation"), "GenerateRequest"
        ),
        "TokenEvent": _stamp(TokenEvent.model_json_schema(mode="serialization"), "TokenEvent"),
        "FinalEvent": _stamp(FinalEvent.model_json_schema(mode="serialization"), "FinalEvent"),
        "ErrorEvent": _stamp(ErrorEvent.model_json_schema(mode="serialization"), "ErrorEvent"),
        "OutputEvent": _stamp(
            TypeAdapter(OutputEvent).json_schema(mode="serialization"), "OutputEvent"
        ),
        "ToolCallMessage": _stamp(
            ToolCallMessage.model_json_schema(mode="validation"), "ToolCallMessage"
        ),
        "ToolResultMessage": _stamp(
            ToolResultMessage.model_json_schema(mode="serialization"), "ToolResultMessage"
        ),
        "HarnessRequest": _stamp(
            HarnessRequest.model_json_schema(mode="validation"), "HarnessRequest"
        ),
        "HarnessStep": _stamp(HarnessStep.model_json_schema(mode="serialization"), "HarnessStep"),
        "HarnessFinal": _stamp(
            HarnessFinal.model_json_schema(mode="serialization"), "HarnessFinal"
        ),
        "HarnessDelta": _stamp(
            HarnessDelta.model_json_schema(mode="serialization"), "HarnessDelta"
        ),
        "Approval": _stamp(Approval.model_json_schema(mode="validation"), "Approval"),
    }
