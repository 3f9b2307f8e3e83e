"""The ``python`` tool sluice ships: a model's program run in the sandbox, its printed output the
result (``sluice tools serve sluice.tools.python_tool:python``). A program that fails (an
exception, a limit reached) is a `ToolError` whose message tells the model why, so that it can
correct its program and call again."""

from __future__ import annotations

from typing import Any

from sluice.tools.registry import InvalidArguments, Tool, ToolError
from sluice.tools.sandbox import Limits, Sandbox

NAME = "python"
DESCRIPTION = (
    "Run a Python 3 program and return what it prints. Print the values you need. Only the "
    "standard library is there; no network; files may be written to the current directory, "
    "which is empty at each call."
)
PARAMETERS: dict[str, Any] = {
    "type": "object",
    "properties": {"code": {"type": "string", "description": "The whole program."}},
    "required": ["code"],
    "additionalProperties": False,
}


class PythonTool:
    """Runs programs in a sandbox made at its first call (making one checks bubblewrap runs)."""

    def __init__(self, limits: Limits | None = None):
        self.limits = limits
        self._sandbox: Sandbox | None = None

    def __call__(self, code: Any = None, **unexpected: Any) -> str:
        if unexpected or not isinstance(code, str):
            raise InvalidArguments('give one argument, "code": the program, as a string')
        if self._sandbox is None:
            self._sandbox = Sandbox(self.limits)
        outcome = self._sandbox.run_python(code)
        if not outcome.ok:
            raise ToolError(outcome.summary())
        return outcome.stdout if outcome.stdout else "(the program printed nothing)"


def python_tool(limits: Limits | None = None) -> Tool:
    # Idempotent: a program's only effects are in its own scratch directory.
    return Tool(NAME, DESCRIPTION, PARAMETERS, run=PythonTool(limits), validate=False)


python = python_tool()
DEFINITION = python.definition
