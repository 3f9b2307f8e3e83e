"""A request's tools on their way through the pipeline: what its chat template is given, the grammar
its sampling follows when it must call, and the calls its completions' text holds.

The model's family decides how calls are written (`engine/tool_formats.py`, on the tokenizer);
this module maps a request's wire fields onto it. A completion's calls are read from its whole text
at each step (`output_reader.py`), never from a reader's memory, so a completion resumed after a
crash is read as the uninterrupted one was, and each call's id is derived from the request, the
completion and the call's place: the same on every copy of an event.
"""

from __future__ import annotations

import hashlib
from typing import Any

from sluice.engine.tokenizer import Tokenizer
from sluice.engine.tool_formats import Tools, ToolView
from sluice.schemas import GenerateRequest
from sluice.schemas.events import CalledFunction, GeneratedToolCall
from sluice.schemas.tools import NamedToolChoice


def tools_of(request: GenerateRequest) -> Tools | None:
    """The request's tools as the engine's formats take them; None without tools."""
    if request.tools is None:
        return None
    choice = request.tool_choice
    return Tools(
        functions=tuple(t.model_dump(exclude_none=True) for t in request.tools),
        choice="required" if isinstance(choice, NamedToolChoice) else (choice or "auto"),
        forced=choice.function.name if isinstance(choice, NamedToolChoice) else None,
        parallel=request.parallel_tool_calls,
    )


def template_tools(request: GenerateRequest) -> list[dict[str, Any]] | None:
    """The tools the chat template describes to the model: with tool_choice "none" too (as vLLM
    does by default: the model still knows them, and a session's prompt keeps its prefix), but
    then its text is not read for calls."""
    tools = tools_of(request)
    return [dict(t) for t in tools.functions] if tools is not None else None


def sampling_kwargs(request: GenerateRequest, tokenizer: Tokenizer | None) -> dict[str, Any]:
    """The request's sampling parameters; a request with tools samples by the grammar of its
    model's calls where there is one (`ToolFormat.grammar`), unless it gave a response_format
    (which the schema refuses beside a tool_choice that requires calls)."""
    kwargs = request.sampling_kwargs()
    tools = tools_of(request)
    shaped = request.response_format is not None and request.response_format.type != "text"
    if tools is None or not tools.parsed or tokenizer is None or shaped:
        return kwargs
    grammar = tokenizer.tool_format.grammar(tools)
    if grammar is not None:
        kwargs["response_format"] = {"type": "grammar", "grammar": grammar}
    return kwargs


def call_id(request_id: str, index: int, place: int) -> str:
    """A call's id: the same wherever and however often the call is read."""
    digest = hashlib.sha256(f"{request_id}/{index}/{place}".encode()).hexdigest()
    return "call_" + digest[:24]


def wire_calls(request_id: str, index: int, view: ToolView, first: int = 0) -> list[dict]:
    """The view's calls from `first` on, as events carry them (dicts of `GeneratedToolCall`)."""
    return [
        GeneratedToolCall(
            index=place,
            id=call_id(request_id, index, place),
            function=CalledFunction(name=call.name, arguments=call.arguments),
        ).model_dump()
        for place, call in enumerate(view.calls[first:], start=first)
    ]
