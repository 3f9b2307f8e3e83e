"""Python functions served as tools: ``@tool`` makes a function one, its parameters' JSON Schema
read from its signature (with pydantic, so ``Annotated[int, Field(ge=0)]`` says more) and its
description from its docstring; a `Toolbox` is what ``sluice tools serve module:obj`` serves.

    from sluice.tools import tool

    @tool
    def add(a: int, b: int) -> int:
        \"\"\"Add two integers.\"\"\"
        return a + b

    @tool(idempotent=False)
    def send_mail(to: str, body: str) -> str: ...

A tool is `idempotent` unless it says otherwise: a call whose worker stopped while running it is
run again. One that is not (it has effects beyond its answer) is never run twice: such a call is
answered with an ``interrupted`` error instead, and the model may call again.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from pydantic import TypeAdapter, ValidationError, validate_call


class ToolError(Exception):
    """A call that could not be served: its message is what the model reads instead of a result."""


class InvalidArguments(ToolError):
    """The arguments do not fit the tool's parameters."""


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: dict[str, Any]  # a JSON Schema of "type": "object"
    run: Callable[..., Any]  # takes the arguments as keywords
    idempotent: bool = True
    validate: bool = True  # check the arguments against `parameters` before running

    @property
    def definition(self) -> dict[str, Any]:
        """The tool as a request's ``tools`` lists it (OpenAI's shape)."""
        function = {"name": self.name, "description": self.description}
        return {"type": "function", "function": {**function, "parameters": self.parameters}}

    def __call__(self, arguments: str) -> str:
        """Run the tool on the arguments a model wrote (a JSON object as text); the result as
        text (a string as it is, anything else as JSON)."""
        try:
            decoded = json.loads(arguments)
        except ValueError as e:
            raise InvalidArguments(f"the arguments are not JSON: {e}") from None
        if not isinstance(decoded, dict):
            raise InvalidArguments("the arguments must be a JSON object")
        try:
            result = self.run(**decoded)
        except ValidationError as e:
            problems = "; ".join(
                f"{'.'.join(str(p) for p in err['loc']) or 'arguments'}: {err['msg']}"
                for err in e.errors()
            )
            raise InvalidArguments(problems) from None
        except TypeError as e:
            if self.validate:
                raise
            raise InvalidArguments(str(e)) from None
        return result if isinstance(result, str) else json.dumps(result, ensure_ascii=False)


def tool(
    fn: Callable[..., Any] | None = None,
    *,
    name: str | None = None,
    description: str | None = None,
    idempotent: bool = True,
) -> Any:
    """Make a function a `Tool` (``@tool`` or ``@tool(name=..., idempotent=False)``)."""

    def make(function: Callable[..., Any]) -> Tool:
        # (a function's TypeAdapter gives its arguments' schema)
        schema = TypeAdapter(function).json_schema()  # type: ignore[arg-type]
        schema.pop("title", None)
        return Tool(
            name=name or function.__name__,
            description=description or inspect.cleandoc(function.__doc__ or ""),
            parameters={"type": "object", **schema},
            run=validate_call(function),
            idempotent=idempotent,
        )

    return make(fn) if fn is not None else make


class Toolbox:
    """Tools by name."""

    def __init__(self, tools: Iterable[Tool]):
        self.tools: dict[str, Tool] = {}
        for t in tools:
            if t.name in self.tools:
                raise ValueError(f"two tools are named {t.name!r}")
            self.tools[t.name] = t

    @classmethod
    def of(cls, obj: Any) -> Toolbox:
        """A toolbox from a `Toolbox`, a `Tool`, or a list of tools."""
        if isinstance(obj, Toolbox):
            return obj
        if isinstance(obj, Tool):
            return cls([obj])
        if isinstance(obj, (list, tuple)) and all(isinstance(t, Tool) for t in obj):
            return cls(obj)
        raise TypeError(f"not a tool, a list of tools or a Toolbox: {obj!r}")

    @property
    def definitions(self) -> list[dict[str, Any]]:
        return [t.definition for t in self.tools.values()]
