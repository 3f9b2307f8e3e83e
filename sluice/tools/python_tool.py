"""The ``python`` tool sluice ships: a model's program run in the sandbox, its printed output the
result. A program that fails (an exception, a limit reached) is a `ToolError` whose message tells
the model why, so that it can correct its program and call again."""

from __future__ import annotations

from typing import Any

from sluice.tools.sandbox import Limits, Sandbox

NAME = "python"
DEFINITION: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": NAME,
        "description": (
            "Run a Python 3 program and return what it prints. Print the values you need. "
            "Only the standard library is there; no network; files may be written to the "
            "current directory, which is empty at each call."
        ),
        "parameters": {
            "type": "object",
            "properties": {"code": {"type": "string", "description": "The whole program."}},
            "required": ["code"],
            "additionalProperties": False,
        },
    },
}


class ToolError(Exception):
    """A call that could not be served: its message is the result the model sees."""


class PythonTool:
    def __init__(self, limits: Limits | None = None):
        self.sandbox = Sandbox(limits)

    def __call__(self, code: str) -> str:
        outcome = self.sandbox.run_python(code)
        if not outcome.ok:
            raise ToolError(outcome.summary())
        return outcome.stdout if outcome.stdout else "(the program printed nothing)"
