"""``@tool``: a function's signature and docstring become its definition, the arguments a model
writes are checked against it (a mistake is an `InvalidArguments` naming the argument), and its
result is text for the model."""

from __future__ import annotations

from typing import Annotated

import pytest
from jsonschema import Draft202012Validator
from pydantic import Field

from sluice.tools import InvalidArguments, Tool, Toolbox, tool


@tool
def forecast(city: str, days: Annotated[int, Field(ge=1, le=7)] = 1) -> dict:
    """The weather in a city for the next days."""
    return {"city": city, "days": days, "sky": "clear"}


@tool(name="send", idempotent=False)
def send_mail(to: str) -> str:
    """Send a mail."""
    return f"sent to {to}"


def test_a_function_becomes_a_tool_definition():
    assert isinstance(forecast, Tool) and forecast.idempotent
    function = forecast.definition["function"]
    assert function["name"] == "forecast"
    assert function["description"] == "The weather in a city for the next days."
    schema = function["parameters"]
    assert schema["type"] == "object" and schema["required"] == ["city"]
    assert schema["properties"]["days"]["maximum"] == 7
    Draft202012Validator.check_schema(schema)
    assert send_mail.name == "send" and not send_mail.idempotent


def test_arguments_are_checked_and_results_are_text():
    assert forecast('{"city": "Oslo", "days": 2}') == '{"city": "Oslo", "days": 2, "sky": "clear"}'
    assert send_mail('{"to": "ann"}') == "sent to ann"
    for arguments, says in [
        ('{"days": 2}', "city"),
        ('{"city": "Oslo", "days": 9}', "days"),
        ('{"city": "Oslo", "hours": 3}', "hours"),
        ("[1, 2]", "JSON object"),
        ("{city: Oslo}", "not JSON"),
    ]:
        with pytest.raises(InvalidArguments, match=says):
            forecast(arguments)


def test_a_toolbox_holds_tools_by_name_once():
    box = Toolbox.of([forecast, send_mail])
    assert list(box.tools) == ["forecast", "send"] and len(box.definitions) == 2
    assert Toolbox.of(forecast).tools == {"forecast": forecast}
    with pytest.raises(ValueError, match="two tools"):
        Toolbox([forecast, forecast])
    with pytest.raises(TypeError):
        Toolbox.of("forecast")
