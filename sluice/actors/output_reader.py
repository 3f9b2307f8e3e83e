"""A request's completions as its client reads them: the reasoning (with a reasoning parser), the
content, and the tool calls (with tools), each step's share of them while a completion runs and
all of them once it has ended.

A completion's text is read whole at each step, never from a reader's memory, so a completion
resumed after a crash (a reader made afresh) is read as the uninterrupted one was. Each view
extends the one before it (the formats withhold what may still change: `reasoning_formats.py`,
`tool_formats.py`), so the deltas a stream sends add up to the final's fields and never take
anything back.
"""

from __future__ import annotations

from dataclasses import dataclass

from sluice.actors.tool_calls import tools_of, wire_calls
from sluice.engine.reasoning_formats import ReasoningFormat
from sluice.engine.tokenizer import Tokenizer
from sluice.engine.tool_formats import ToolFormat, Tools, ToolView
from sluice.schemas import GenerateRequest


@dataclass(frozen=True)
class OutputView:
    reasoning: str
    tools: ToolView  # the content after the reasoning, and the calls made in it


@dataclass(frozen=True)
class Read:
    """What a step added (its deltas and the calls it completed), or a whole completion."""

    reasoning: str
    content: str
    calls: list[dict]


class OutputReader:
    def __init__(
        self,
        request_id: str,
        tools: Tools | None,
        tool_format: ToolFormat | None,
        reasoning: ReasoningFormat | None,
    ):
        self.request_id = request_id
        self.tools = tools
        self.tool_format = tool_format
        self.reasoning = reasoning
        # Per completion, the text last read while it ran and its view: the next step's "before"
        # (so each step reads its text once; a reader made after a resume reads it afresh).
        self._running: dict[int, tuple[str, OutputView]] = {}

    @staticmethod
    def for_request(request: GenerateRequest, tokenizer: Tokenizer | None) -> OutputReader | None:
        """A reader where the text is more than content: a reasoning parser, or tools to call
        (not with tool_choice "none"); None where it is all content."""
        if tokenizer is None:
            return None
        tools = tools_of(request)
        if tools is not None and not tools.parsed:
            tools = None
        if tools is None and tokenizer.reasoning_format is None:
            return None
        return OutputReader(
            request.request_id, tools, tokenizer.tool_format, tokenizer.reasoning_format
        )

    def view(self, text: str, final: bool) -> OutputView:
        thought, content = "", text
        if self.reasoning is not None:
            split = self.reasoning.view(text, final)
            thought, content = split.reasoning, split.content
        if self.tools is None or self.tool_format is None:
            return OutputView(thought, ToolView(content))
        calls = self.tool_format.view(content, self.tools, final)
        if not self.tools.parallel and len(calls.calls) > 1:  # (where no grammar held it to one)
            calls = ToolView(calls.content, calls.calls[:1])
        return OutputView(thought, calls)

    def step(self, index: int, before: str, added: str, final: bool) -> Read:
        """What `added` text after `before` adds: the deltas, and the calls it completed."""
        seen = self._running.get(index)
        was = seen[1] if seen is not None and seen[0] == before else self.view(before, False)
        text = before + added
        now = self.view(text, final)
        if final:
            self._running.pop(index, None)
        else:
            self._running[index] = (text, now)
        return Read(
            now.reasoning[len(was.reasoning) :],
            now.tools.content[len(was.tools.content) :],
            wire_calls(self.request_id, index, now.tools, len(was.tools.calls)),
        )

    def ended(self, index: int, text: str) -> Read:
        """The reasoning, the content and every call of a completion that ended with `text`."""
        view = self.view(text, final=True)
        return Read(
            view.reasoning, view.tools.content, wire_calls(self.request_id, index, view.tools)
        )
