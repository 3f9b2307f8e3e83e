"""Two more families' tool-call formats: Mistral's (`[TOOL_CALLS]` then a JSON array of calls, or
`name[ARGS]{...}` per call) and the pythonic one of Llama 3.2/4 and Gemma 3 (an answer that is only
a Python list of calls, `[f(a=1)]`, bare or fenced). Each is read as written, streams without
taking text back, and holds a call that must be made to the tools' schemas by its grammar (checked
by llguidance on a real tokenizer)."""

from __future__ import annotations

import json

import pytest

from sluice.engine.loader import load_tokenizer
from sluice.engine.tool_formats import (
    MistralFormat,
    PythonicFormat,
    ToolCall,
    Tools,
    ToolView,
    detect,
    template_inputs,
)
from tests.engine.test_tool_formats import OSLO, PYTHON, TOOLS, WEATHER, _walk

MISTRAL, PYTHONIC = MistralFormat(), PythonicFormat()
CODE = ToolCall("python", '{"code": "print(1)"}')


@pytest.mark.parametrize(
    "text, view",
    [
        ("It is sunny.", ToolView("It is sunny.")),
        (
            'Let me look.[TOOL_CALLS][{"name": "weather", "arguments": {"city": "Oslo"}}, '
            '{"name": "python", "arguments": {"code": "print(1)"}}]',
            ToolView("Let me look.", (OSLO, CODE)),
        ),
        (  # (newer tokenizers: a mark and [ARGS] per call)
            '[TOOL_CALLS]weather[ARGS]{"city": "Oslo"}[TOOL_CALLS]python[ARGS]{"code": "print(1)"}',
            ToolView("", (OSLO, CODE)),
        ),
        ("[TOOL_CALLS] not json", ToolView("[TOOL_CALLS] not json")),
    ],
)
def test_mistral_reads_the_content_and_calls_of_an_ended_text(text, view):
    assert MISTRAL.view(text, TOOLS, final=True) == view


@pytest.mark.parametrize(
    "text, calls",
    [
        ('[weather(city="Oslo")]', (OSLO,)),
        ("[weather(city='Oslo'), python(code='print(1)')]", (OSLO, CODE)),
        ("```tool_code\nprint(weather(city='Oslo'))\n```", (OSLO,)),  # (as Gemma writes it)
        (
            '[weather(city="Oslo", days=None)]',
            (ToolCall("weather", '{"city": "Oslo", "days": null}'),),
        ),
        (
            "[weather(city='Oslo', days=true)]",
            (ToolCall("weather", '{"city": "Oslo", "days": true}'),),
        ),
    ],
)
def test_pythonic_reads_an_answer_that_is_only_calls(text, calls):
    assert PYTHONIC.view(text, TOOLS, final=True) == ToolView("", calls)


@pytest.mark.parametrize(
    "text",
    [
        "[1, 2, 3]",  # a list, but not of calls
        '[weather("Oslo")]',  # arguments by position: not this format's
        '[search(q="x")]',  # not a tool
        "[weather(city=__import__('os').getcwd())]",  # not a literal: never evaluated
        "The weather is [unknown].",
        "```python\nprint('hi')\n```",
    ],
)
def test_pythonic_leaves_anything_else_as_text(text):
    assert PYTHONIC.view(text, TOOLS, final=True) == ToolView(text)


@pytest.mark.parametrize(
    "fmt, text",
    [
        (MISTRAL, 'Checking.[TOOL_CALLS][{"name": "weather", "arguments": {"city": "Oslo"}}]'),
        (PYTHONIC, "[weather(city='Oslo')]"),
        (PYTHONIC, "Sunny, I think."),
    ],
)
def test_a_stream_of_views_never_takes_back_content_or_calls(fmt, text):
    shown, calls = "", ()
    for end in range(len(text) + 1):
        view = fmt.view(text[:end], TOOLS, final=end == len(text))
        assert view.content.startswith(shown) and view.calls[: len(calls)] == calls
        shown, calls = view.content, view.calls
    assert ToolView(shown, calls) == fmt.view(text, TOOLS, final=True)
    assert MISTRAL.view("Checking.[TOOL", TOOLS, final=False).content == "Checking."


def test_formats_are_detected_or_named():
    assert detect("{% for m in messages %}[TOOL_CALLS]{{ m.tool_calls|tojson }}{% endfor %}") is (
        MistralFormat
    )


def test_the_grammars_of_required_calls_hold_names_and_arguments_to_the_schemas():
    tokenizer, _ = load_tokenizer(None)
    mistral = MistralFormat(tokenizer).grammar(Tools((WEATHER, PYTHON), choice="required"))
    oslo = json.dumps({"name": "weather", "arguments": {"city": "Oslo", "days": 2}})
    code = json.dumps({"name": "python", "arguments": {"code": "print(1)"}})
    assert _walk(tokenizer, mistral, f"[TOOL_CALLS][{oslo}, {code}]")
    assert not _walk(tokenizer, mistral, f"[{oslo}]")  # the mark first
    assert not _walk(tokenizer, mistral, '[TOOL_CALLS][{"name": "weather", "arguments": {}}]')
    one = MistralFormat(tokenizer).grammar(Tools((WEATHER,), choice="required", parallel=False))
    assert _walk(tokenizer, one, f"[TOOL_CALLS][{oslo}]")
    assert not _walk(tokenizer, one, f"[TOOL_CALLS][{oslo}, {oslo}]")
    assert MistralFormat(tokenizer).grammar(Tools((WEATHER,))) is None  # (the mark is text here)

    pythonic = PythonicFormat(tokenizer).grammar(Tools((WEATHER, PYTHON), choice="required"))
    assert _walk(tokenizer, pythonic, '[weather(city="Oslo", days=2), python(code="print(1)")]')
    assert _walk(tokenizer, pythonic, '[weather(city="Oslo")]')
    assert not _walk(tokenizer, pythonic, "[weather(days=2)]")  # city is required
    assert not _walk(tokenizer, pythonic, "[weather(city=3)]")
    assert not _walk(tokenizer, pythonic, 'Sure: [weather(city="Oslo")]')
    named = PythonicFormat(tokenizer).grammar(
        Tools((WEATHER, PYTHON), choice="required", forced="python")
    )
    assert _walk(tokenizer, named, '[python(code="1")]')
    assert not _walk(tokenizer, named, '[weather(city="Oslo")]')
    assert PythonicFormat(tokenizer).grammar(Tools((WEATHER,))) is None
    # what the grammar lets through, the format reads as the calls it means
    view = PYTHONIC.view('[weather(city="Oslo", days=2)]', TOOLS, final=True)
    assert view.calls == (ToolCall("weather", '{"city": "Oslo", "days": 2}'),)


def test_a_template_without_tools_gets_them_in_the_pythonic_form():
    call = {
        "id": "c",
        "type": "function",
        "function": {"name": "weather", "arguments": '{"city": "Oslo"}'},
    }
    messages, tools = template_inputs(
        PYTHONIC,
        False,
        [
            {"role": "user", "content": "Weather in Oslo?"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c", "content": "rain"},
        ],
        [WEATHER],
    )
    assert tools is None and "Python list" in messages[0]["content"]
    assert messages[2] == {"role": "assistant", "content": "[weather(city='Oslo')]"}
    assert messages[3] == {"role": "user", "content": "```tool_output\nrain\n```"}
    # what it wrote of the earlier call reads back as that call
    assert PYTHONIC.view(messages[2]["content"], TOOLS, final=True).calls == (OSLO,)
