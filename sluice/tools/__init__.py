"""Tools a model calls through the queue: ``@tool`` functions served by `ToolWorker`
(``sluice tools serve module:obj``), the messages they exchange (`schemas/tool_messages.py`), and
the ``python`` tool sluice ships with its sandbox."""

from sluice.tools.registry import InvalidArguments, Tool, Toolbox, ToolError, tool

__all__ = ["InvalidArguments", "Tool", "ToolError", "Toolbox", "tool"]
