"""How a reasoning model sets its thinking apart from its answer: the text between ``<think>`` and
``</think>`` is the completion's `reasoning`, the rest its content (read for tool calls after it).

Parsers (``--reasoning-parser``; none by default, as in vLLM: a model's text is all content):

* ``qwen3`` (Qwen3, QwQ, and models that open their thinking themselves): a completion that
  begins with ``<think>`` reasons until ``</think>``; one that does not is all content;
* ``deepseek_r1`` (DeepSeek-R1 and its distillations, whose chat template opens the thinking in
  the prompt): a completion reasons from its start until ``</think>`` (a ``<think>`` it writes
  itself is dropped).

A thought not closed by the end stays reasoning, so that what a stream sent as reasoning is never
taken back. While a completion runs (``final=False``) a view withholds what may still be part of
a tag (the first characters of ``<think>`` at the start, of ``</think>`` at the end of the
reasoning) and the white space at the end of the reasoning, so that each view extends the one
before it. The reasoning is stripped of white space at both ends, the content at its start.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from sluice.engine.errors import EngineError
from sluice.engine.tool_formats import partial_suffix

OPEN, CLOSE = "<think>", "</think>"


@dataclass(frozen=True)
class ReasoningView:
    reasoning: str
    content: str  # the text after the thinking (all of it, without any)


class ReasoningFormat:
    """One family's way of setting its thinking apart (see the module's docstring)."""

    name: ClassVar[str]
    opens_in_prompt: ClassVar[bool]  # whether a completion begins inside its thinking

    def view(self, text: str, final: bool) -> ReasoningView:
        head = text.lstrip()
        if head.startswith(OPEN):
            return self._thinking(head[len(OPEN) :], final)
        if not final and OPEN.startswith(head):  # (nothing yet, or the tag's first characters)
            return ReasoningView("", "")
        if self.opens_in_prompt:
            return self._thinking(text, final)
        return ReasoningView("", text)

    @staticmethod
    def _thinking(body: str, final: bool) -> ReasoningView:
        end = body.find(CLOSE)
        if end >= 0:
            return ReasoningView(body[:end].strip(), body[end + len(CLOSE) :].lstrip())
        if not final:
            body = body[: len(body) - partial_suffix(body, CLOSE)].rstrip()
        return ReasoningView(body.strip(), "")


class Qwen3Format(ReasoningFormat):
    name = "qwen3"
    opens_in_prompt = False


class DeepSeekR1Format(ReasoningFormat):
    name = "deepseek_r1"
    opens_in_prompt = True


FORMATS: dict[str, type[ReasoningFormat]] = {f.name: f for f in (Qwen3Format, DeepSeekR1Format)}


def named(name: str) -> ReasoningFormat:
    try:
        return FORMATS[name]()
    except KeyError:
        raise EngineError(
            f"unknown reasoning parser {name!r} (known: {', '.join(sorted(FORMATS))})",
            "reasoning_parser",
        ) from None
