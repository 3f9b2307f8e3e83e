"""A reasoning model's thinking told from its answer (`--reasoning-parser`): qwen3's completions
open `<think>` themselves, deepseek_r1's begin inside it. Read while it runs, each view extends the
one before (a stream's deltas add up to the final's fields and take nothing back), however the text
is cut into steps; with tools, the calls are read from the answer after the thinking."""

from __future__ import annotations

import pytest

from sluice.actors.output_reader import OutputReader
from sluice.engine.errors import EngineError
from sluice.engine.reasoning_formats import DeepSeekR1Format, Qwen3Format, ReasoningView, named
from sluice.engine.tool_formats import HermesFormat, Tools

QWEN3 = "<think>\nThe sum of 2 and 2 is 4.\n</think>\n\nIt is 4."
R1 = "Two and two make four.\n</think>\n\nFour."


@pytest.mark.parametrize(
    "fmt, text, reasoning, content",
    [
        (Qwen3Format(), QWEN3, "The sum of 2 and 2 is 4.", "It is 4."),
        (Qwen3Format(), "It is 4.", "", "It is 4."),  # (no thinking: all content)
        (Qwen3Format(), "  <think>unfinished", "unfinished", ""),  # (cut off: still thinking)
        (Qwen3Format(), "<thinking> is a tag", "", "<thinking> is a tag"),
        (DeepSeekR1Format(), R1, "Two and two make four.", "Four."),
        (DeepSeekR1Format(), "<think>x</think>y", "x", "y"),  # (its own open tag dropped)
        (DeepSeekR1Format(), "no end", "no end", ""),
    ],
)
def test_the_thinking_and_the_answer_of_a_whole_completion(fmt, text, reasoning, content):
    assert fmt.view(text, final=True) == ReasoningView(reasoning, content)


@pytest.mark.parametrize("fmt, text", [(Qwen3Format(), QWEN3), (DeepSeekR1Format(), R1)])
def test_each_view_of_a_running_completion_extends_the_one_before(fmt, text):
    last = fmt.view(text, final=True)
    before = ReasoningView("", "")
    for end in range(len(text) + 1):
        now = fmt.view(text[:end], final=False)
        assert now.reasoning.startswith(before.reasoning), text[:end]
        assert now.content.startswith(before.content), text[:end]
        assert last.reasoning.startswith(now.reasoning) and last.content.startswith(now.content)
        assert "<" not in now.reasoning and "<" not in now.content  # (no tag's first characters)
        before = now


def reader(**tools) -> OutputReader:
    chosen = Tools(tuple(tools["functions"])) if tools else None
    return OutputReader("r-1", chosen, HermesFormat(), Qwen3Format())


ADD = {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}


@pytest.mark.parametrize("cut", [1, 3, 7])
def test_a_readers_deltas_add_up_to_the_ended_completion_with_its_calls(cut):
    text = '<think>I should add.</think>\n<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n'
    text += "</tool_call>"
    read = reader(functions=[ADD])
    reasoning = content = ""
    calls: list[dict] = []
    for start in range(0, len(text), cut):
        step = read.step(0, text[:start], text[start : start + cut], start + cut >= len(text))
        reasoning, content, calls = (
            reasoning + step.reasoning,
            content + step.content,
            calls + step.calls,
        )
    whole = read.ended(0, text)
    assert (reasoning, content, calls) == (whole.reasoning, whole.content, whole.calls)
    assert whole.reasoning == "I should add." and whole.content == ""
    assert [c["function"]["name"] for c in whole.calls] == ["add"]


def test_a_reasoning_parser_alone_reads_requests_without_tools_and_unknown_ones_are_refused():
    whole = reader().ended(0, QWEN3)
    assert (whole.reasoning, whole.content, whole.calls) == (
        "The sum of 2 and 2 is 4.",
        "It is 4.",
        [],
    )
    assert named("qwen3").name == "qwen3" and named("deepseek_r1").opens_in_prompt
    with pytest.raises(EngineError, match="unknown reasoning parser 'o1'"):
        named("o1")
