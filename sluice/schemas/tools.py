"""Tools a request offers the model, and the calls the model makes: OpenAI's Chat Completions
shapes (``tools``, ``tool_choice``, an assistant message's ``tool_calls``), in sluice's requests as
in OpenAI-shaped ones.

A call's ``arguments`` are a JSON object written as a string, as OpenAI sends them; a call's ``id``
is what a ``role: "tool"`` message names in ``tool_call_id`` when it brings the call's result.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, JsonValue
from pydantic_core import PydanticCustomError

MAX_TOOLS = 128
MAX_TOOL_CALLS = 128
FUNCTION_NAME = r"^[a-zA-Z0-9_-]{1,64}$"  # OpenAI's rule for a function's name


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


def _object_text(value: str) -> str:
    try:
        decoded = json.loads(value)
    except ValueError:
        decoded = None
    if not isinstance(decoded, dict):
        raise PydanticCustomError("invalid_arguments", "must be a JSON object written as a string")
    return value


def _json_schema(value: dict[str, Any]) -> dict[str, Any]:
    kind = value.get("type", "object")
    if kind != "object":
        raise PydanticCustomError(
            "invalid_parameters",
            'must be a JSON Schema of "type": "object" (got {kind!r})',
            {"kind": kind},
        )
    return value


class FunctionDefinition(_Strict):
    name: str = Field(pattern=FUNCTION_NAME, description="Letters, digits, _ and -; 64 at most.")
    description: str | None = None
    parameters: Annotated[dict[str, JsonValue], AfterValidator(_json_schema)] | None = Field(
        None, description="The arguments, as a JSON Schema object; absent means none."
    )
    strict: bool | None = Field(
        None,
        description="Accepted; arguments follow the schema whenever the tool must be called.",
    )


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(_Strict):
    name: str = Field(pattern=FUNCTION_NAME)


class NamedToolChoice(_Strict):
    """Call this function (and only it)."""

    type: Literal["function"]
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class FunctionCall(_Strict):
    name: str = Field(min_length=1)
    arguments: Annotated[str, AfterValidator(_object_text)]


class ToolCall(_Strict):
    """A call the model made (in an assistant message of the conversation)."""

    id: str = Field(min_length=1, max_length=128)
    type: Literal["function"] = "function"
    function: FunctionCall


def check_tools(tools: list[Tool] | None, choice: ToolChoice | None, prompt_is_chat: bool) -> None:
    """The rules between a request's tool fields; raises PydanticCustomError naming the field."""
    if tools is None:
        if choice is not None and choice != "none":
            raise PydanticCustomError(
                "needs_tools", "needs tools (there is nothing to call)", {"field": "tool_choice"}
            )
        return
    if not prompt_is_chat:
        raise PydanticCustomError(
            "needs_messages", "need messages: tools are offered in a chat", {"field": "tools"}
        )
    names = [t.function.name for t in tools]
    if len(set(names)) != len(names):
        raise PydanticCustomError("duplicate_tool", "two tools have one name", {"field": "tools"})
    if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
        raise PydanticCustomError(
            "unknown_tool",
            "names '{name}', which is not one of the tools",
            {"field": "tool_choice", "name": choice.function.name},
        )


__all__ = [
    "MAX_TOOLS",
    "MAX_TOOL_CALLS",
    "FunctionCall",
    "FunctionDefinition",
    "NamedToolChoice",
    "Tool",
    "ToolCall",
    "ToolChoice",
    "check_tools",
]
