"""Tool-call formats: a completion's text read as content and calls, as it streams and when it ends
(each view's content extends the one before, so a stream of deltas never takes text back); the
grammar of a call that must be made, checked by llguidance on the real tokenizers; and the chat
messages a template is given, with and without a template that renders tools."""

from __future__ import annotations

import json

import llguidance
import pytest
from jsonschema import Draft202012Validator

from sluice.engine.errors import EngineError
from sluice.engine.loader import catalog, load_tokenizer
from sluice.engine.tool_formats import (
    HermesFormat,
    Llama3JsonFormat,
    ToolCall,
    Tools,
    ToolView,
    detect,
    template_inputs,
)

WEATHER = {
    "type": "function",
    "function": {
        "name": "weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
PYTHON = {
    "type": "function",
    "function": {
        "name": "python",
        "parameters": {
            "type": "object",
            "properties": {"code": {"type": "string"}},
            "required": ["code"],
        },
    },
}
TOOLS = Tools((WEATHER, PYTHON))
HERMES = HermesFormat()
OSLO = ToolCall("weather", '{"city": "Oslo"}')

# (text, content, calls) when the text ends
ENDED = [
    ("It is sunny.", "It is sunny.", ()),
    (
        'Let me look.\n<tool_call>\n{"name": "weather", "arguments": {"city": "Oslo"}}\n'
        "</tool_call>",
        "Let me look.",
        (OSLO,),
    ),
    (
        '<tool_call>\n{"name": "weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "python", "arguments": {"code": "print(2)"}}\n</tool_call>\n',
        "",
        (OSLO, ToolCall("python", '{"code": "print(2)"}')),
    ),
    # not JSON inside the tags: text
    ("<tool_call>\nweather(Oslo)\n</tool_call>", "<tool_call>\nweather(Oslo)\n</tool_call>", ()),
    # the model ended without closing its call
    ('<tool_call>\n{"name": "weather", "arguments": {"city": "Oslo"}}', "", (OSLO,)),
    # cut short inside the call: text
    ('<tool_call>\n{"name": "weather", "argu', '<tool_call>\n{"name": "weather", "argu', ()),
    # one call written as a fenced or bare JSON object (Qwen2.5-Coder's habit)
    ('```json\n{"name": "weather", "arguments": {"city": "Oslo"}}\n```', "", (OSLO,)),
    ('{"name": "weather", "arguments": {"city": "Oslo"}}', "", (OSLO,)),
    ('[{"name": "weather", "arguments": {"city": "Oslo"}}]', "", (OSLO,)),
    # a program written over several lines inside its JSON string, as small models do
    (
        '```json\n{"name": "python", "arguments": {"code": "x = 6\nprint(x * 7)"}}\n```',
        "",
        (ToolCall("python", '{"code": "x = 6\\nprint(x * 7)"}'),),
    ),
    # ... but JSON that names no tool is an answer, and so is code in another language
    ('{"name": "Ada", "arguments": {}}', '{"name": "Ada", "arguments": {}}', ()),
    ("```python\nprint(1)\n```", "```python\nprint(1)\n```", ()),
    ('{"city": "Oslo"}', '{"city": "Oslo"}', ()),
    ("Use <tool_call> tags.", "Use <tool_call> tags.", ()),
]


@pytest.mark.parametrize("text, content, calls", ENDED)
def test_hermes_reads_the_content_and_calls_of_an_ended_text(text, content, calls):
    assert HERMES.view(text, TOOLS, final=True) == ToolView(content, calls)


@pytest.mark.parametrize("text", [t for t, _, _ in ENDED])
def test_a_stream_of_views_never_takes_back_content_or_calls(text):
    """Cut after every character, as tokens arrive: each view extends the one before, and the
    deltas add up to the ended text's view."""
    shown, calls = "", ()
    for end in range(len(text) + 1):
        view = HERMES.view(text[:end], TOOLS, final=end == len(text))
        assert view.content.startswith(shown), (text[:end], view.content, shown)
        assert view.calls[: len(calls)] == calls
        shown, calls = view.content, view.calls
    assert ToolView(shown, calls) == HERMES.view(text, TOOLS, final=True)


def test_while_streaming_what_may_become_a_call_is_held_back():
    assert HERMES.view("Checking <tool_", TOOLS, final=False).content == "Checking"
    assert HERMES.view('Checking <tool_call>\n{"na', TOOLS, final=False).content == "Checking"
    assert HERMES.view('{"name": "weather"', TOOLS, final=False).content == ""
    assert HERMES.view("```json\n{", TOOLS, final=False).content == ""
    # a fence of another language is shown as soon as its first line says so
    assert HERMES.view("```python\nprint", TOOLS, final=False).content == "```python\nprint"


def test_llama3_json_reads_calls_separated_by_semicolons():
    text = (
        '{"name": "weather", "parameters": {"city": "Oslo"}}; '
        '{"name": "python", "parameters": {"code": "1"}}'
    )
    view = Llama3JsonFormat().view(text, TOOLS, final=True)
    assert view == ToolView("", (OSLO, ToolCall("python", '{"code": "1"}')))
    assert Llama3JsonFormat().view(text, TOOLS, final=False) == ToolView("")
    assert Llama3JsonFormat().view("Sunny.", TOOLS, final=True) == ToolView("Sunny.")
    # the separator its grammar allows after the last call, and a ';' inside an argument
    code = '{"name": "python", "parameters": {"code": "a = 1; print(a)"}}; '
    assert Llama3JsonFormat().view(code, TOOLS, final=True) == ToolView(
        "", (ToolCall("python", '{"code": "a = 1; print(a)"}'),)
    )


def test_formats_are_detected_from_the_chat_template():
    assert detect("{% if tools %}...<tool_call>...{% endif %}") is HermesFormat
    assert detect('{% if tools %}{"name": ..., "parameters": ...}{% endif %}') is Llama3JsonFormat
    assert detect("{{ message['content'] }}") is HermesFormat  # (sluice writes the tools)
    assert detect(None) is HermesFormat


def _walk(tokenizer, grammar: str, text: str) -> bool:
    """Whether the grammar lets the tokenizer's tokens of `text` through and may end there."""
    lltokenizer = llguidance.LLTokenizer(
        tokenizer.backend.to_str(), eos_token=list(tokenizer.eos_token_ids)
    )
    matcher = llguidance.LLMatcher(lltokenizer, llguidance.LLMatcher.grammar_from_lark(grammar))
    assert not matcher.is_error(), matcher.get_error()
    for token in tokenizer.encode(text, add_special_tokens=False):
        if not matcher.consume_token(token):
            return False
    return matcher.is_accepting()


def _hermes_call(name: str, arguments: dict) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def test_the_grammar_of_required_calls_holds_names_and_arguments_to_the_schemas():
    tokenizer, _ = load_tokenizer(None)  # the default model: no tool tokens, the tags as text
    fmt = HermesFormat(tokenizer)
    grammar = fmt.grammar(Tools((WEATHER, PYTHON), choice="required"))
    oslo = _hermes_call("weather", {"city": "Oslo", "days": 2})
    code = _hermes_call("python", {"code": "print(1)"})
    assert _walk(tokenizer, grammar, oslo)
    assert _walk(tokenizer, grammar, f"{oslo}\n{code}\n")  # parallel calls
    assert not _walk(tokenizer, grammar, "Sure. " + oslo)  # nothing but calls
    assert not _walk(tokenizer, grammar, _hermes_call("weather", {"days": 2}))  # city required
    assert not _walk(tokenizer, grammar, _hermes_call("weather", {"city": 3}))
    assert not _walk(tokenizer, grammar, _hermes_call("search", {"q": "x"}))  # not a tool
    assert not _walk(tokenizer, grammar, oslo.replace('": "', '":"'))  # one way to write JSON
    one = fmt.grammar(Tools((WEATHER, PYTHON), choice="required", parallel=False))
    assert _walk(tokenizer, one, oslo) and not _walk(tokenizer, one, f"{oslo}\n{code}")
    named = fmt.grammar(Tools((WEATHER, PYTHON), choice="required", forced="python"))
    assert _walk(tokenizer, named, code) and not _walk(tokenizer, named, oslo)


def test_with_auto_no_grammar_where_a_call_cannot_be_told_from_text():
    tokenizer, _ = load_tokenizer(None)  # the tag is characters any text may hold
    assert HermesFormat(tokenizer).grammar(Tools((WEATHER,))) is None
    assert Llama3JsonFormat(tokenizer).grammar(Tools((WEATHER,))) is None
    assert Llama3JsonFormat(tokenizer).grammar(Tools((WEATHER,), choice="required")) is not None


def test_a_template_without_tools_gets_them_written_in_by_sluice():
    tokenizer, _ = load_tokenizer(None)  # SmolLM2's template knows nothing of tools
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "weather", "arguments": '{"city": "Oslo"}'},
    }
    messages = [
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "rain"},
    ]
    text = tokenizer.apply_chat_template(messages, True, tools=[WEATHER])
    system = text.split("<|im_end|>")[0]
    assert system.startswith("<|im_start|>system\n# Tools") and '"name": "weather"' in system
    assert (
        '<|im_start|>assistant\n<tool_call>\n{"name": "weather", "arguments": {"city": "Oslo"}}'
        "\n</tool_call><|im_end|>" in text
    )
    assert "<|im_start|>user\n<tool_response>\nrain\n</tool_response><|im_end|>" in text
    # without tools, the same conversation renders as before (a plain chat has no system added)
    plain = [{"role": "user", "content": "Hi"}]
    assert tokenizer.apply_chat_template(plain, True) == tokenizer.apply_chat_template(
        plain, True, tools=None
    )


def test_a_template_that_renders_tools_gets_them_and_decoded_arguments():
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
    messages, tools = template_inputs(
        HERMES, True, [{"role": "assistant", "content": None, "tool_calls": [call]}], [WEATHER]
    )
    assert tools == [WEATHER]
    assert messages[0]["tool_calls"][0]["function"]["arguments"] == {"a": 1}
    assert call["function"]["arguments"] == '{"a": 1}'  # (the caller's message is left alone)


def _qwen_tokenizer():
    try:
        path = catalog.locate("qwen2.5-coder-1.5b")
    except EngineError as e:
        pytest.skip(
            f"qwen2.5-coder-1.5b is not pulled (sluice models pull qwen2.5-coder-1.5b): {e}"
        )
    tokenizer, _ = load_tokenizer(path)
    return tokenizer


def test_qwen_writes_its_tool_tags_as_its_own_tokens_under_the_grammar():
    tokenizer = _qwen_tokenizer()
    assert isinstance(tokenizer.tool_format, HermesFormat)
    grammar = tokenizer.tool_format.grammar(Tools((WEATHER,), choice="required"))
    call = _hermes_call("weather", {"city": "Oslo"})
    assert tokenizer.encode("<tool_call>", add_special_tokens=False) == [
        tokenizer.token_to_id("<tool_call>")
    ]
    assert _walk(tokenizer, grammar, call)
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Weather?"}], True, tools=[WEATHER]
    )
    assert "<tools>" in rendered and json.dumps(WEATHER) in rendered  # Qwen's own tools block
    # the arguments the grammar lets through validate against the tool's schema
    view = tokenizer.tool_format.view(call, Tools((WEATHER,)), final=True)
    schema = WEATHER["function"]["parameters"]
    assert list(Draft202012Validator(schema).iter_errors(json.loads(view.calls[0].arguments))) == []


def test_with_auto_qwen_writes_any_text_but_each_call_it_opens_follows_the_schema():
    tokenizer = _qwen_tokenizer()
    grammar = tokenizer.tool_format.grammar(Tools((WEATHER, PYTHON)))
    assert grammar is not None
    oslo = _hermes_call("weather", {"city": "Oslo"})
    assert _walk(tokenizer, grammar, "It is sunny in Oslo today.")
    assert _walk(tokenizer, grammar, '```json\n{"name": "weather"}\n```')  # (read, not held)
    assert _walk(tokenizer, grammar, f"Let me look.\n{oslo}\n")
    assert not _walk(tokenizer, grammar, _hermes_call("weather", {"town": "Oslo"}))
    assert not _walk(tokenizer, grammar, "<tool_call>\nweather(Oslo)\n</tool_call>")
    assert not _walk(tokenizer, grammar, f"{oslo}\nAnd more text.")
